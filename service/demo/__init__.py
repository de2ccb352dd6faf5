"""The built-in demo model: written once into the cache directory, then reused.

$KVSENTRY_CACHE_DIR (or ~/.cache/kvsentry)/demo/<preset>-<hash of the arguments>/ holds a
complete Hugging Face checkpoint. Concurrent first starts are safe: each writes into its own
temporary directory and the first rename wins.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine import envs

DEFAULT_DEMO_PRESET = "tiny-deepseek-v3"
DEFAULT_DEMO_DP = 2
# `kvsentry serve --demo NAME` -> preset. "moe" is the mission's scenario: MoE + MLA over DP
# ranks with expert parallelism, where idle ranks run dummy batches.
DEMOS = {"moe": DEFAULT_DEMO_PRESET}
# Large enough weights that greedy text is not a uniform draw over the vocabulary.
DEMO_INIT_SCALE = 0.3


def default_demo_path(preset: str = DEFAULT_DEMO_PRESET, **overrides) -> Path:
    """The checkpoint directory of `preset`, writing it first if it is not there yet."""
    from service.demo import checkpoint as demo_checkpoint

    args = {"init_scale": DEMO_INIT_SCALE, **overrides}
    spec = json.dumps({"preset": demo_checkpoint.DEMO_PRESETS.get(preset), "args": args}, sort_keys=True)
    tag = hashlib.sha256(spec.encode()).hexdigest()[:10]
    target = envs.cache_dir() / "demo" / f"{preset}-{tag}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        demo_checkpoint.write_preset(scratch, preset, **args)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target
