"""JobConfig validation and its one-to-one mapping onto the `hsx` CLI and job files (no Ray, no model)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cli.args import EXIT_USAGE, config_from_args, config_to_argv, field_docs
from cli.main import build_parser, main
from extractor.options import flag
from jobs.config import JobConfig


def _parse(*argv):
    return config_from_args(build_parser().parse_args(["run", *argv]))


def test_every_config_field_has_a_flag_whose_help_is_its_docstring():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    by_dest = {a.dest: a for a in run._actions}
    docs = field_docs(JobConfig)
    for f in dataclasses.fields(JobConfig):
        assert f.name in by_dest, f"JobConfig.{f.name} has no flag"
        assert flag(f.name) in by_dest[f.name].option_strings
        assert docs[f.name] and by_dest[f.name].help.startswith(docs[f.name].replace("%", "%%")[:40])


def test_flags_build_the_typed_config():
    cfg = _parse("--model", "m", "--corpus", "a.jsonl", "b.parquet", "--output", "out", "--layers", "2,3,4",
                 "--workers", "3", "--gpus-per-worker", "0.5", "--dtype", "bf16", "--include-output-tokens",
                 "--max-tokens", "4", "--storage-options", '{"anon": true}', "--no-progress")
    assert cfg.corpus == ("a.jsonl", "b.parquet")
    assert cfg.layers == (2, 3, 4)
    assert cfg.workers == 3 and cfg.gpus_per_worker == 0.5
    assert cfg.dtype == "bfloat16"
    assert cfg.include_output_tokens and cfg.max_tokens == 4
    assert cfg.storage_options == {"anon": True}
    assert cfg.progress is False


def test_job_file_loads_the_same_config_and_flags_override_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: m\ncorpus: [a.jsonl]\noutput: out\nlayers: [1, 2]\nworkers: 2\nmax-model-len: 128\n"
                   "storage_options: {client_kwargs: {endpoint_url: 'http://x'}}\n")
    cfg = _parse("--config", str(job), "--workers", "5")
    assert cfg.layers == (1, 2) and cfg.max_model_len == 128
    assert cfg.workers == 5  # the flag wins
    assert cfg.storage_options == {"client_kwargs": {"endpoint_url": "http://x"}}
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps(cfg.to_dict()))
    assert _parse("--config", str(as_json)) == cfg


def test_config_round_trips_through_argv():
    cfg = JobConfig(model="m", corpus=("a", "b"), output="s3://b/run", layers=(2, 4), workers=2, max_workers=8, max_tokens=3,
                    include_output_tokens=True, progress=False, storage_options={"k": {"v": 1}}, overlength="skip",
                    layout="sharded", shard_mb=0.5, verbose=True)
    assert _parse(*config_to_argv(cfg)) == cfg  # hsx submit's `hsx run` argv: --verbose included
    regen = JobConfig(model="m", corpus=("a",), output="o", regenerate_with=("http://a:8000", "http://b:8000"),
                      regenerate={"max_tokens": 64, "reasoning": "strip"})
    assert _parse(*config_to_argv(regen)) == regen
    assert regen.regenerate_config().server == ("http://a:8000", "http://b:8000")


def test_media_flags_round_trip_through_argv_and_reach_the_media_policy(tmp_path):
    argv = ["--model", "m", "--corpus", "a", "--output", "o", "--allow-media-fetch", "--allowed-media-domains",
            "img.example", "127.0.0.1", "--image-fetch-timeout-s", "2.5", "--max-image-bytes", "3000",
            "--max-request-image-bytes", "9000"]
    cfg = _parse(*argv)
    assert cfg.allowed_media_domains == ("img.example", "127.0.0.1")
    assert _parse(*config_to_argv(cfg)) == cfg
    job = tmp_path / "job.yaml"
    job.write_text("model: m\ncorpus: [a]\noutput: o\nallowed_media_domains: [img.example, 127.0.0.1]\n")
    assert _parse("--config", str(job)).allowed_media_domains == ("img.example", "127.0.0.1")
    job.write_text("model: m\ncorpus: [a]\noutput: o\nallowed_media_domains: img.example, cdn.example\n")
    one = _parse("--config", str(job))  # a string: split at commas (hsx submit spelled it out letter by letter)
    assert one.allowed_media_domains == ("img.example", "cdn.example") and _parse(*config_to_argv(one)) == one
    policy = cfg.media_policy()
    assert (policy.allowed_media_domains, policy.image_fetch_timeout_s, policy.max_image_bytes,
            policy.max_request_image_bytes) == (("img.example", "127.0.0.1"), 2.5, 3000, 9000)
    for given in ("https://img.example/", "img.example:8080"):  # a port would never match a URL's host
        with pytest.raises(ValueError, match="--allowed-media-domains takes host names"):
            JobConfig(model="m", corpus=("a",), output="o", allowed_media_domains=(given,)).media_policy()
    with pytest.raises(ValueError, match="--max-image-bytes must be a positive"):
        JobConfig(model="m", corpus=("a",), output="o", max_image_bytes=0).media_policy()


@pytest.mark.parametrize("argv, flag_named", [
    (["--layers", "2,x"], "--layers"),
    (["--workers", "0"], "--workers"),
    (["--workers", "4", "--max-workers", "2"], "--max-workers"),
    (["--storage-retry-seconds", "0"], "--storage-retry-seconds"),
    (["--layout", "shards"], "--layout"),
    (["--layout", "sharded", "--shard-mb", "0"], "--shard-mb"),
    (["--include-output-tokens"], "--include-output-tokens"),
    (["--storage-options", "{not json"], "--storage-options"),
    (["--max-model-len", "8", "--max-tokens", "8"], "--max-tokens"),
    (["--packing", "yes"], "--packing"),
])
def test_bad_settings_are_usage_errors_that_name_the_flag(argv, flag_named, capsys):
    base = ["run", "--model", "m", "--corpus", "c.jsonl", "--output", "o"]
    with pytest.raises(SystemExit) as e:
        main(base + argv)
    assert e.value.code == EXIT_USAGE
    assert flag_named in capsys.readouterr().err


def test_missing_required_setting_and_unknown_job_file_key_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", "m", "--corpus", "c.jsonl"])
    assert e.value.code == EXIT_USAGE and "--output is required" in capsys.readouterr().err
    job = tmp_path / "job.yaml"
    job.write_text("model: m\nworkerz: 2\n")
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", str(job)])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and "workerz" in err and "workers" in err


def test_verbose_is_a_run_and_demo_setting_that_hsx_v_implies(monkeypatch):
    import cli.jobs
    from jobs.config import DemoConfig

    seen = []
    monkeypatch.setattr(cli.jobs, "_cmd_run", lambda args: seen.append(config_from_args(args, JobConfig).verbose))
    monkeypatch.setattr(cli.jobs, "_cmd_demo", lambda args: seen.append(config_from_args(args, DemoConfig).verbose))
    job = ["--model", "m", "--corpus", "c.jsonl", "--output", "o"]
    for argv in (["run", *job], ["run", *job, "--verbose"], ["-v", "run", *job], ["-v", "run", *job, "--no-verbose"],
                 ["demo", "d"], ["demo", "d", "--verbose"], ["-v", "demo", "d"]):
        assert main(argv) == 0
    assert seen == [False, True, True, False, False, True, True]


def test_unknown_flag_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["run", "--no-such-flag"])
    assert e.value.code == 2


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for command in ("run", "submit", "status", "estimate", "demo", "export"):
        assert command in out


def _commands():
    from jobs.config import CompactConfig, DemoConfig, EstimateConfig, StatusConfig, SubmitConfig
    from jobs.report_config import ReportConfig
    from jobs.verify_config import VerifyConfig
    from regeneration.config import RegenerateConfig
    from serve.config import ServeConfig
    from training.evaluate import EvalDrafterConfig
    from training.export import ExportConfig
    from training.mtp_target import MergeMtpConfig
    from training_jobs.config import TrainJobConfig

    return {"run": JobConfig, "submit": SubmitConfig, "status": StatusConfig, "estimate": EstimateConfig,
            "demo": DemoConfig, "verify": VerifyConfig, "export": ExportConfig, "train-drafter": TrainJobConfig,
            "eval-drafter": EvalDrafterConfig, "serve": ServeConfig, "compact": CompactConfig,
            "regenerate": RegenerateConfig, "report": ReportConfig, "merge-mtp": MergeMtpConfig}


def test_every_command_is_a_typed_config_mapped_one_to_one_with_a_config_file():
    """No hand-written flags: each subcommand's arguments are exactly its config's fields, plus --config."""
    commands = _commands()
    subparsers = build_parser()._subparsers._group_actions[0].choices
    assert set(subparsers) == set(commands)  # a new command comes with its config
    for name, cls in commands.items():
        actions = {a.dest: a for a in subparsers[name]._actions if a.dest not in ("help", "hsx_positional")}
        assert "--config" in actions.pop("config").option_strings, name
        assert set(actions) == {f.name for f in dataclasses.fields(cls)}, name
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring: its flag would have no help"


def test_any_commands_settings_come_from_a_file_and_the_flags_given_win(tmp_path, capsys):
    from connectors import HiddenStatesSpec
    from harness.runs import random_samples, write_run
    from jobs.config import DemoConfig

    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=8, dtype="float32", model="m")
    run = tmp_path / "run"
    write_run(str(run), random_samples(3, spec), spec)
    status = tmp_path / "status.yaml"
    status.write_text(f"output: {run}\njson: true\nerrors: 2\n")
    assert main(["status", "--config", str(status)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] == 3
    demo = tmp_path / "demo.json"
    demo.write_text(json.dumps({"dir": "from-file", "workers": 3}))
    parsed = config_from_args(build_parser().parse_args(["demo", "--config", str(demo), "--workers", "2"]), DemoConfig)
    assert (parsed.dir, parsed.workers, parsed.progress) == ("from-file", 2, True)
    status.write_text(f"output: {run}\ncorpus: x.jsonl\n")  # a key of another command's config
    with pytest.raises(SystemExit) as e:
        main(["status", "--config", str(status)])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and "unknown keys ['corpus']" in err and "valid keys: output," in err
    with pytest.raises(SystemExit) as e:
        main(["train-drafter", "--run", str(run), "--out", str(tmp_path / "o")])
    assert e.value.code == EXIT_USAGE and "--model is required (or key 'model'" in capsys.readouterr().err


def test_job_and_serve_share_one_set_of_engine_options():
    from extractor.options import EngineOptions
    from serve.config import ServeConfig

    shared = {f.name for f in dataclasses.fields(EngineOptions)}
    for cls in (JobConfig, ServeConfig):
        assert issubclass(cls, EngineOptions) and shared <= {f.name for f in dataclasses.fields(cls)}
        docs = field_docs(cls)
        assert all(docs.get(name) for name in shared), cls  # every shared flag keeps its help
    # the same bad value is refused the same way, naming the same flag, by both commands
    for cls in (JobConfig, ServeConfig):
        with pytest.raises(ValueError, match="--max-num-batched-tokens must be a positive integer"):
            cls(model="m", output="o", max_num_batched_tokens=0)
        with pytest.raises(ValueError, match="--dtype"):
            cls(dtype="int3")
    serve = ServeConfig(model="m", output="o", revision="abc", trust_remote_code=True, max_num_seqs=4)
    engine = serve.engine_config()
    assert (engine.revision, engine.trust_remote_code, engine.max_num_seqs) == ("abc", True, 4)


def test_layer_ids_are_checked_once_where_they_enter_and_carried_typed():
    import pickle

    from transformers import LlamaConfig

    from connectors.format import LayerIds, check_layer_ids
    from extractor.facts import target_facts

    job = JobConfig(model="m", output="o", layers="1, 2,4")
    assert isinstance(job.layers, LayerIds) and job.layers == (1, 2, 4) and job.layers.num_hidden_layers is None
    assert job.engine_config().layer_ids is job.layers  # the engine takes them as they are
    hf = LlamaConfig(num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
    facts = target_facts(hf, model="m", layer_ids=job.layers)  # the range, once N is known
    assert facts.layer_ids == (1, 2, 4) and facts.layer_ids.num_hidden_layers == 4
    spec = facts.file_spec()
    assert spec.layer_ids is facts.layer_ids  # the file spec (and the runner's capture) check nothing again
    assert check_layer_ids(spec.layer_ids, 4) is spec.layer_ids
    again = pickle.loads(pickle.dumps(spec.layer_ids))  # what a Ray worker gets
    assert again == (1, 2, 4) and again.num_hidden_layers == 4
    with pytest.raises(ValueError, match=r"out of range for a model with 3 decoder layers"):
        check_layer_ids(spec.layer_ids, 3)  # checked against another model: checked again
    with pytest.raises(ValueError, match="duplicates"):
        JobConfig(layers=[2, 2])
