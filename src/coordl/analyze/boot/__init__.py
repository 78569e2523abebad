"""Start-up code for the processes ``coordl analyze`` runs: this folder goes first on their
``PYTHONPATH``, so that Python runs its ``sitecustomize`` when each interpreter starts."""
