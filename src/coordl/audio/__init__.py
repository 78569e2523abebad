"""Audio datasets: which files are clips, and what is wrong with a clip before it is decoded.

How the parts fit together: :mod:`.formats` names the formats DALI's audio decoder reads and
checks a clip's header on the host (a truncated WAV or Ogg stream, a sample rate of 0, no
samples), where the decoder would return a short or empty waveform without an error. The recipes
(:class:`~coordl.prep.recipes.AudioTrain`, :class:`~coordl.prep.recipes.AudioVal`) and their DALI
operators (:mod:`coordl.prep.graph`) decode, downmix, resample and cut a window; the window's
start is drawn from ``(seed, epoch, sample)`` like an image's crop.
"""
