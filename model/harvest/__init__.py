"""The harvest pipeline: activation datasets for SAE training and probing, as resumable shards.

Reading and packing text in `text.py`, shards, the manifest and resuming in `shards.py`, one job per
output folder in `lock.py`, SAELens' cached format in `saelens.py`, the job in `job.py`, the Ray Data
backend in `ray_data.py` (the one module that imports Ray). The network is not here: the job reads it
through `model.hooks.run_with_cache`.
"""

from .errors import HarvestError
from .job import FORMATS, HarvestSpec, harvest, run_harvest
from .shards import MANIFEST, Manifest, ShardRecord
from .text import open_source, pack

__all__ = [
    "FORMATS",
    "MANIFEST",
    "HarvestError",
    "HarvestSpec",
    "Manifest",
    "ShardRecord",
    "harvest",
    "open_source",
    "pack",
    "run_harvest",
]
