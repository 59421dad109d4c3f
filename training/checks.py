"""The checks before any training step: the target folder, the run, and whether the run can train --kind.

    target_config(model)                   the target's transformers config (ValueError: not a model folder)
    open_dataset(config, run=None)         the run as the trainer reads it (raw layout, samples truncated)
    check_layers(config, spec, what, fix)  the run's (or stream's) layers against what --kind needs
    check_run(config) -> (dataset, target) every check of a stored --run: not empty, from this target (shape,
                                           architecture, config; a fingerprint that differs is a warning),
                                           holding the layers --kind needs, its first sample readable and in the
                                           target's vocabulary
    check_live_writer(config) -> writer    an `hsx run` writing --run now: refused unless --snapshot
"""

from __future__ import annotations

import json
import logging
import os

from connectors.fingerprint import FINGERPRINT_SCHEME, model_fingerprint
from connectors.folders import MANIFEST_DIR
from connectors.lease import snapshot_writer
from connectors.manifest import REQUIRED_COLUMNS, committed_rows, read_manifest
from connectors.run import RunDir, RunSpec
from drafters.base import TargetHead
from drafters.features import run_fit
from drafters.registry import family_features
from extractor.facts import target_facts
from training.dataset import HiddenStatesDataset
from training.feed import CheckedFeed
from training.train_config import TrainDrafterConfig

logger = logging.getLogger(__name__)


def target_config(model: str):
    """The target's transformers config; ValueError when --model is not a local model folder or unreadable."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model!r} is not a local model folder (no config.json); pass the folder of the "
                         "target model the run was extracted from")
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model!r}: cannot read its config ({e})") from e


def _same_model(run_spec, model_dir: str, hf) -> list[str]:
    """Why the run was not extracted from the model at `model_dir` ([] = it was, as far as the records tell): the
    run's recorded shape and architecture against the engine's facts of the target (extractor.facts.target_facts),
    then the recorded model folder's config.json, when it is still there."""
    target = RunSpec.from_file_spec(target_facts(hf, model=model_dir).file_spec())
    said = {"num_hidden_layers": "the run's model has {0} layers, the target {1}",
            "hidden_size": "the run's states are {0} wide, the target's {1}",
            "architecture": "the run's model is a {0}, the target a {1}"}
    problems = [said[name].format(ours, theirs) for name, (ours, theirs) in run_spec.differences(target, list(said)).items()
                if name != "architecture" or (ours and theirs)]
    recorded = run_spec.model
    if recorded and os.path.isfile(os.path.join(recorded, "config.json")) and \
            os.path.realpath(recorded) != os.path.realpath(model_dir):
        with open(os.path.join(recorded, "config.json")) as a, open(os.path.join(model_dir, "config.json")) as b:
            if json.load(a) != json.load(b):
                problems.append(f"the run was extracted from {recorded}, whose config.json differs from the target's")
    return problems


def _warn_if_other_weights(run_spec, model_dir: str, hf) -> None:
    """Warn when the run's recorded model fingerprint (connectors.fingerprint: config,
    tokenizer, weight files' headers, sizes and times) differs from the target folder's. Not a refusal: a copy of the
    same model differs too (its files' times), but so does another fine-tune of the same base, which the config
    checks above cannot tell apart and whose states would train a drafter for the wrong model."""
    recorded = run_spec.model_fingerprint or ""
    if not recorded.startswith(FINGERPRINT_SCHEME):
        return  # no fingerprint, or the first round's scheme: nothing to compare with
    here = model_fingerprint(model_dir, hf)
    if here == recorded:
        return
    logger.warning("the run %s records model fingerprint %s, the target %s has %s: its weights, config or tokenizer "
                   "files are not the ones the run was extracted from (or they were copied since). If it is another "
                   "model (a different fine-tune of the same base), the drafter will learn the wrong states: train "
                   "against the model the run was extracted from", run_spec.model, recorded, model_dir, here)


def _committed_samples(config: TrainDrafterConfig) -> int | None:
    """Samples the run's manifest commits (None: no manifest to count, the dataset says what is wrong)."""
    try:
        run = RunDir(config.run, config.storage_options)
        if not run.exists(MANIFEST_DIR):
            return None
        return committed_rows(read_manifest(run, columns=list(REQUIRED_COLUMNS))).num_rows
    except (OSError, ValueError):
        return None


def open_dataset(config: TrainDrafterConfig, run: str | None = None):
    """The run (default --run) as the trainer reads it (raw layout, samples truncated to --batch-tokens, with their
    ids)."""
    run = run or config.run
    from drafters.registry import drafter_class

    try:  # only the families that embed tokens themselves read (and need) the stored image embeddings
        reads = getattr(drafter_class(config.kind), "reads_image_embeddings", False)
    except ValueError:
        reads = False  # an unknown --kind is refused by its own check
    try:
        return HiddenStatesDataset(run, layout="raw", storage_options=config.storage_options,
                                   max_length=config.batch_tokens, include_sample_id=True,
                                   image_inputs=config.image_inputs if reads else "placeholder")
    except (OSError, ValueError) as e:
        raise ValueError(f"{run}: cannot open the run ({e})") from e


def check_layers(config: TrainDrafterConfig, spec, what: str, layers_fix: str) -> None:
    """ValueError when the states `spec` describes cannot train --kind: another layer convention, a post-norm last
    layer, a top-k target for a kind that reads layer N, layers missing (`layers_fix` names the fix, {ids} the
    layers to ask for)."""
    if spec.layer_id_convention != "vllm":
        raise ValueError(f"{what} counts layers in the {spec.layer_id_convention!r} convention; drafters "
                         "read hsx runs in vLLM's ids — re-extract with hsx")
    n = int(spec.num_hidden_layers)
    if spec.last_layer_normalized and n in spec.layer_ids:
        raise ValueError(f"{what} stored layer {n} after the final norm; drafters apply the target's "
                         "final norm themselves and need it pre-norm (hsx's default) — re-extract without normalising")
    fit = run_fit(family_features(config.kind), spec)  # what the family declares it reads (drafters.features)
    if fit.top_k_refused:
        raise ValueError(f"--kind {config.kind} trains on the state of layer {n} itself, but {what} "
                         f"keeps a {spec.target} target in its place (the target's top-{spec.target_top_k} "
                         "next-token log-probabilities, which only EAGLE-3-style training reads); re-extract "
                         f"with --target states and layer {n} in --layers for {config.kind}")
    if fit.missing:
        ids = ",".join(str(i) for i in fit.suggested)
        raise ValueError(f"--kind {config.kind} needs layers {list(fit.needed)} but {what} stores "
                         f"{list(spec.layer_ids)} (missing {list(fit.missing)}); " + layers_fix.format(ids=ids))


def check_run(config: TrainDrafterConfig):
    """(dataset, target head) once the target folder, the run and the kind's needs are checked; ValueError naming
    the fix otherwise."""
    hf = target_config(config.model)
    if _committed_samples(config) == 0:
        raise ValueError(f"--run {config.run} has no extracted samples (its manifest holds no 'ok' rows); run the "
                         "extraction first (`hsx run`), or see why its samples failed with `hsx status`")
    ds = open_dataset(config)
    spec = ds.run_info
    if len(ds) == 0 or int(ds.num_tokens.sum()) == 0:
        raise ValueError(f"--run {config.run} has no extracted samples (its manifest holds no 'ok' rows); run the "
                         "extraction first (`hsx run`), or check it with `hsx status`")
    problems = _same_model(spec, config.model, hf)
    if problems:
        raise ValueError(f"--run {config.run} is not from the target --model {config.model}: {'; '.join(problems)}. "
                         "Train against the model the run was extracted from (or re-extract with this one)")
    _warn_if_other_weights(spec, config.model, hf)
    check_layers(config, spec, f"--run {config.run}", "re-extract with --layers {ids}")
    target = TargetHead.from_model_dir(config.model)
    first = next(CheckedFeed(ds, skip=config.skip_bad_samples).token_items(), None)
    if first is None:
        raise ValueError(f"--run {config.run}: none of its {len(ds)} samples can be read (see the warnings); run "
                         f"`hsx verify {config.run} --all`, then re-run the extraction")
    first = first["input_ids"]
    if first.numel() and int(first.max()) >= target.vocab_size:
        raise ValueError(f"--run {config.run} holds token id {int(first.max())}, outside the target's vocabulary of "
                         f"{target.vocab_size}: the run is from another tokenizer or model")
    return ds, target


def check_live_writer(config: TrainDrafterConfig) -> str | None:
    """The live writer of --run, described, when --snapshot lets the training read what it committed so far; None
    when no writer is live. ValueError naming the writer and --snapshot when one is and --snapshot was not given."""
    try:
        run = RunDir(config.run, config.storage_options)
    except (OSError, ValueError):
        return None  # an unreadable run: check_run says what is wrong with it
    try:
        return snapshot_writer(run, snapshot=config.snapshot, what=f"--run {config.run}",
                               harm="a training would read only the samples committed so far and could not resume "
                                    "once more are", doing="train on what it has committed now")
    except OSError:
        return None  # storage that does not answer: check_run says so
