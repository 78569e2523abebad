"""Object detection: samples whose target is a set of boxes, and the SSD recipes' geometry.

How the parts fit together: :mod:`.boxes` holds every sample's boxes as flat arrays
(:class:`~.boxes.Boxes`, part of an :class:`~coordl.index.Index`, saved and fingerprinted with
it); :mod:`.coco` reads COCO's ``instances_*.json`` (and a tar shard sample's ``.json`` member)
into those arrays, checking every field; :mod:`.crops` is pure: the SSD300 crop, flip and colour
twist of a sample as a function of ``(seed, epoch, sample)``, and the boxes they deliver;
:mod:`.targets` lays a delivered batch's boxes out as the targets a detection model takes. The SSD
recipes themselves are :mod:`coordl.prep.ssd`: this package imports nothing from :mod:`coordl.prep`.

A batch's boxes never travel through DALI, the HP group's staging area or Ray: the pipeline is
fed each sample's crop window, flip and colour (:func:`.crops.plan`), and whoever delivers the
batch computes its boxes from the same function of the sample ids, so the pixels and the boxes
agree by construction on every path.
"""
