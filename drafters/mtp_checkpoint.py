"""A target's MTP tensors on disk: read from its checkpoint, written back tuned, checked to be made for a target.

    mtp_weight_map(dir)                    checkpoint key -> file (extractor.checkpoint_files), ValueError in one line
    expert_sources(key, shape, files)      the checkpoint keys a module tensor is read from (per-expert groups for
                                           transformers' fused expert tensors)
    read_mtp_tensors(dir, files, sources)  hsx name -> tensor, each read from the shards holding its keys
    write_target_with(target_dir, drafter_dir, out_dir)   `hsx merge-mtp`: a copy of the target, its MTP tensors
                                           replaced by tuned ones, only the shards holding them rewritten
    check_source(model_dir, target_dir, what)   ValueError when the MTP layers at model_dir were made for another
                                           target (drafters.target_identity)
    preflight(model_dir, target_dir)       the registry's check before an engine loads (hsx serve): MTP layers
                                           declared, their tensors there, made for this target

The layouts are drafters/mtp_styles.py's; the model reading them (MtpHead.from_folder) and writing them
(checkpoint_tensors) is drafters/mtp.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from drafters.mtp_styles import is_mtp_key, mtp_style, read_config_json
from drafters.target_identity import check_made_for
from extractor.checkpoint_files import load_tensors, weight_map

logger = logging.getLogger(__name__)


def _unreadable():
    """The exceptions a damaged checkpoint file raises (safetensors' SafetensorError is a plain Exception)."""
    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, KeyError, SafetensorError)


def mtp_weight_map(model_dir: str) -> dict[str, str]:
    """Checkpoint key -> file of `model_dir`'s checkpoint; ValueError in one line when there is none or it is
    damaged."""
    try:
        return weight_map(model_dir, "MTP layers are read")
    except _unreadable() as e:  # no weights, an index that is not JSON or has no weight_map, a damaged file
        raise ValueError(f"{model_dir}: cannot read the tensor list of its model.safetensors (or its "
                         f"model.safetensors.index.json): {type(e).__name__}: {e}") from None


def _load_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except _unreadable() as e:
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


_FUSED_EXPERTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
"""transformers' fused expert tensors [E, ...] -> the per-expert projections checkpoints store (gate_up: gate and
up of expert e concatenated along dim 0, as transformers' WeightConverter for these families)."""


def expert_sources(key: str, shape: tuple[int, ...], files: Mapping[str, str] | None = None) -> list[list[str]]:
    """The checkpoint keys a module tensor is read from: [[key]], or for a fused expert tensor not stored fused,
    one group per expert ([[experts.0.gate_proj.weight, experts.0.up_proj.weight], ...])."""
    for fused, projections in _FUSED_EXPERTS.items():
        if key.endswith(fused) and not (files is not None and key in files):
            stem = key[: -len(fused)]
            return [[f"{stem}experts.{e}.{proj}.weight" for proj in projections] for e in range(shape[0])]
    return [[key]]


def read_mtp_tensors(model_dir: str, files: Mapping[str, str], sources: Mapping[str, list[list[str]]]
                     ) -> dict[str, torch.Tensor]:
    """hsx name -> tensor, each read from the shards holding its checkpoint keys (per-expert groups fused)."""
    wanted = sorted({key for groups in sources.values() for group in groups for key in group})
    try:
        raw = load_tensors(model_dir, wanted, files=files)
    except _unreadable() as e:
        shards = sorted({files[key] for key in wanted})
        raise ValueError(f"{model_dir}: cannot read its MTP tensors from {', '.join(shards)} ({e})") from None
    out = {}
    for name, groups in sources.items():
        if len(groups) == 1 and len(groups[0]) == 1:
            out[name] = raw[groups[0][0]]
            continue
        try:
            out[name] = torch.stack([torch.cat([raw[k] for k in group]) for group in groups])
        except RuntimeError as e:
            raise ValueError(f"{model_dir}: the per-expert MTP tensors {groups[0]} do not fit together ({e}); the "
                             "MTP layers are not this target's") from None
    return out


# -- the merge writer (hsx merge-mtp) ----------------------------------------------------------------------------------
def write_target_with(target_dir: str, drafter_dir: str, out_dir: str, *,
                      allow_target_mismatch: bool = False) -> dict[str, Any]:
    """A new target folder at `out_dir`: every file of `target_dir` copied, its MTP tensors replaced by the tuned ones
    `drafter_dir` holds (a `hsx train-drafter --kind mtp` checkpoint), the shards holding them rewritten, nothing
    else changed and `target_dir` never touched. ValueError in one line, nothing written, when out_dir exists and is
    not empty, the layers were tuned for another target (check_source; unless `allow_target_mismatch`), the
    folders' MTP tensors differ in keys or shapes, or a tuned tensor is not finite."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.abspath(out_dir) == os.path.abspath(target_dir):
        raise ValueError(f"--out {out_dir} is the target folder itself; write the tuned target to a new folder")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"--out {out_dir} exists and is not an empty folder; name a new folder")
    check_source(drafter_dir, target_dir, "hsx merge-mtp", allow_mismatch=allow_target_mismatch,
                 override="pass --allow-target-mismatch")
    files = mtp_weight_map(target_dir)
    tuned_map = mtp_weight_map(drafter_dir)
    doc = read_config_json(os.path.join(target_dir, "config.json"))
    found = mtp_style(doc)
    if found is None:
        raise ValueError(f"{target_dir} declares no MTP layers; it is not a target to tune MTP layers of")
    tuned = {}
    for file in sorted(set(tuned_map.values())):
        tuned.update(_load_file(os.path.join(drafter_dir, file)))
    mtp_keys = {k for k in files if is_mtp_key(k, found[0], doc)}
    if set(tuned) != mtp_keys:
        extra, lacking = sorted(set(tuned) - mtp_keys), sorted(mtp_keys - set(tuned))
        raise ValueError(f"{drafter_dir} does not hold exactly {target_dir}'s MTP tensors (not in the target: "
                         f"{extra[:3]}, missing: {lacking[:3]}); it was tuned from another target")
    shards = sorted({files[k] for k in mtp_keys})
    replaced: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
    for shard in shards:
        try:
            with safe_open(os.path.join(target_dir, shard), framework="pt") as f:
                meta = f.metadata() or {"format": "pt"}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except _unreadable() as e:
            raise ValueError(f"{target_dir}/{shard}: not a readable safetensors file ({type(e).__name__}: {e})"
                             ) from None
        for k in [k for k in tensors if k in mtp_keys]:
            new = tuned[k]
            if tuple(new.shape) != tuple(tensors[k].shape):
                raise ValueError(f"{drafter_dir}: {k} has shape {tuple(new.shape)}, the target's is "
                                 f"{tuple(tensors[k].shape)}; it was tuned from another target")
            if new.is_floating_point() and not bool(torch.isfinite(new).all()):
                raise ValueError(f"{drafter_dir}: {k} holds non-finite values; the tuned checkpoint is damaged")
            tensors[k] = new.to(tensors[k].dtype).contiguous()
        replaced[shard] = (tensors, meta)
    tmp = out_dir.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        top = os.path.abspath(target_dir)
        shutil.copytree(target_dir, tmp, ignore=lambda folder, names: [n for n in names if n in shards] if
                        os.path.abspath(folder) == top else [])  # the shards rewritten below; files elsewhere kept
        for shard, (tensors, meta) in replaced.items():
            save_file(tensors, os.path.join(tmp, shard), metadata=meta)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out_dir, "replaced_tensors": len(mtp_keys), "rewritten_shards": shards}


# -- made for this target? ---------------------------------------------------------------------------------------------
def check_source(model_dir: str, target_dir: str, what: str, *, allow_mismatch: bool = False,
                 override: str | None = None) -> None:
    """ValueError when the MTP layers at `model_dir` were not made for `target_dir`: a tuned checkpoint by the
    target digest it recorded (an older one without it: its recorded verifier folder, when there), a target folder
    by its own embeddings, final norm and lm_head, by value (drafters.target_identity). `allow_mismatch`: the
    user's override (logged instead); `override`: how to give it, named in the refusal (default, for a tuned
    checkpoint: merging it with `hsx merge-mtp --allow-target-mismatch`)."""
    doc = read_config_json(os.path.join(model_dir, "config.json"))
    hsx = doc.get("hsx") if isinstance(doc.get("hsx"), dict) else {}
    if override is None and hsx.get("kind") == "mtp":
        override = (f"write them into it with `hsx merge-mtp --model {target_dir} --drafter {model_dir} --out NEW "
                    "--allow-target-mismatch` and use NEW")
    options = {"allow_mismatch": allow_mismatch, "override": override}
    if hsx.get("kind") != "mtp":
        check_made_for(model_dir, target_dir, None, what, **options)
    elif isinstance(hsx.get("target_digest"), str):
        check_made_for(model_dir, target_dir, hsx["target_digest"], what, **options)
    elif isinstance(hsx.get("verifier"), str) and os.path.isdir(hsx["verifier"]):
        check_made_for(hsx["verifier"], target_dir, None, what, **options)
    else:
        logger.warning("%s: %s records no target digest and its verifier %r is not here: cannot check it was tuned for "
                       "%s", what, model_dir, hsx.get("verifier"), target_dir)


def preflight(model_dir: str, target_dir: str) -> None:
    """The registry's check before an engine loads (hsx serve): `model_dir` declares MTP layers, its checkpoint holds
    tensors of them (a target re-saved by transformers lost them), and they were made for `target_dir`."""
    doc = read_config_json(os.path.join(model_dir, "config.json"))
    found = mtp_style(doc)
    if found is None:
        raise ValueError(f"{model_dir} declares no MTP layers; method 'mtp' needs a target folder that ships them or "
                         "a `hsx train-drafter --kind mtp` checkpoint")
    if not any(is_mtp_key(k, found[0], doc) for k in mtp_weight_map(model_dir)):
        raise ValueError(f"{model_dir} declares {found[1]} MTP layer(s) ({found[0].name} style) but its checkpoint "
                         "holds none of their tensors (a target re-saved by transformers drops them); use the "
                         "checkpoint as published, or another method")
    check_source(model_dir, target_dir, "speculative_config method 'mtp'")
