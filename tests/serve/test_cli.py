"""`hsx serve` refuses bad settings with exit 2 naming the flag, before Ray or any replica starts."""

from __future__ import annotations

import os
import time

import pytest

from cli.main import main


@pytest.mark.parametrize("argv, needle", [
    ([], "--model"),
    (["--model", "{model}"], "--output"),
    (["--model", "/no/such/model", "--output", "{out}"], "--model /no/such/model"),
    (["--model", "{model}", "--output", "{out}", "--layers", "1,9"], "--layers"),
    (["--model", "{model}", "--output", "{out}", "--replicas", "0"], "--replicas"),
    (["--model", "{model}", "--output", "{out}", "--port", "70000"], "--port"),
    (["--model", "{model}", "--output", "{out}", "--dtype", "int8"], "--dtype"),
    (["--model", "{model}", "--output", "{out}", "--api-key", " "], "--api-key"),
    (["--model", "{model}", "--output", "{out}", "--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--model", "{model}", "--output", "{out}", "--max-queued-requests", "0"], "--max-queued-requests"),
    (["--model", "{model}", "--output", "{out}", "--api-key", "clé"], "--api-key holds characters outside"),
    (["--model", "{model}", "--output", "{out}", "--api-key", "key "], "--api-key begins or ends with whitespace"),
    (["--model", "{model}", "--output", "{out}", "--storage-options", "{{not json"], "--storage-options"),
    (["--model", "{model}", "--output", "{out}", "--name", "two words"], "--name 'two words'"),
    (["--model", "{model}", "--output", "{out}", "--route-prefix", "llama"], "--route-prefix 'llama'"),
    (["--model", "{model}", "--output", "{out}", "--route-prefix", "/llama/"], "--route-prefix '/llama/'"),
    # a decoding service (--speculative-config): no files, so no --output; its method's own checks
    (["--model", "{model}", "--speculative-config", "{{not json"], "--speculative-config is not valid JSON"),
    (["--model", "{model}", "--speculative-config", '{{"method": "ngram"}}'], "needs num_speculative_tokens"),
    (["--model", "{model}", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 0}}'],
     "num_speculative_tokens must be an integer >= 1"),
    (["--model", "{model}", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 1000000000000}}'],
     "num_speculative_tokens=1000000000000 is more than the 128 tokens"),
    (["--model", "{model}", "--output", "{out}", "--speculative-config", '{{"method": "ngram", '
      '"num_speculative_tokens": 2}}'], "--output with --speculative-config method 'ngram'"),
    (["--model", "{model}", "--layers", "1,2", "--speculative-config", '{{"method": "ngram", '
      '"num_speculative_tokens": 2}}'], "--layers with --speculative-config"),
    (["--model", "{model}", "--speculative-config", '{{"method": "mtp", "num_speculative_tokens": 2}}'],
     "{model} is not a target folder with MTP layers"),
    (["--model", "{model}", "--speculative-config", '{{"method": "eagle3", "num_speculative_tokens": 2}}'],
     "method 'eagle3' needs 'model'"),
    (["--model", "{model}", "--no-files", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 2}}'],
     "--no-files with --speculative-config"),
    (["--model", "{model}", "--no-files", "--layers", "1,2"], "--layers with --no-files without --output"),
])
def test_bad_settings_exit_2_naming_the_flag_before_anything_starts(argv, needle, serve_model, tmp_path, capsys):
    argv = [a.format(model=serve_model, out=tmp_path / "out") for a in argv]
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle.format(model=serve_model) in err and "Traceback" not in err, err
    assert time.monotonic() - start < 10


def test_python_dash_m_cli_gives_the_same_usage_error(tmp_path):
    """`python -m cli` (how the serve tests start hsx) runs cli/__main__.py: a usage error raised in serve/ must
    still be exit 2 with one line, not a traceback."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--model", "/no/such/model", "--output",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--model /no/such/model: no such folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("address, host, warned", [
    ("ray://head:10001", "127.0.0.1", True),
    ("ray://head:10001", "localhost", True),
    ("ray://head:10001", "[::1]", True),
    ("ray://head:10001", "0.0.0.0", False),
    ("ray://head:10001", "10.1.2.3", False),
    ("10.1.2.3:6379", "127.0.0.1", False),  # hsx runs on a node of that cluster
    (None, "127.0.0.1", False),
])
def test_a_loopback_host_through_ray_client_is_warned_about(address, host, warned):
    """Through Ray Client (ray://) hsx is not on the cluster: the proxy's loopback address there is not reachable."""
    from serve.config import ServeConfig
    from serve.server import _unreachable_host

    note = _unreachable_host(ServeConfig(model="m", output="/tmp/o", address=address, host=host))
    assert (note is not None) == warned, note
    if warned:
        assert "--host 0.0.0.0" in note and address in note


def test_an_empty_hsx_api_key_is_refused_like_an_empty_flag(serve_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HSX_API_KEY", "")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", serve_model, "--output", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "$HSX_API_KEY is set but empty" in err and "Traceback" not in err
    monkeypatch.setenv("HSX_API_KEY", "   ")
    with pytest.raises(SystemExit):
        main(["serve", "--model", serve_model, "--output", str(tmp_path / "out")])


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("10.1.2.3", None, True),
                                               ("myhost.example", None, True), ("0.0.0.0", "k", False),
                                               ("127.0.0.1", None, False), ("localhost", None, False),
                                               ("[::1]", None, False)])
def test_an_open_server_beyond_loopback_is_warned_about(host, key, warned, monkeypatch):
    from serve.config import ServeConfig
    from serve.server import open_server_warning

    monkeypatch.delenv("HSX_API_KEY", raising=False)
    note = open_server_warning(ServeConfig(model="m", output="/tmp/o", host=host, api_key=key))
    assert (note is not None) == warned, note
    if warned:
        assert "--api-key" in note and host in note


def _eagle3_head(target: str, out: str) -> str:
    """An (untrained) EAGLE-3 head built for `target` and saved as `hsx train-drafter` saves one."""
    import types

    from drafters.base import TargetHead
    from drafters.eagle3 import Eagle3Drafter

    head = TargetHead.from_model_dir(target)
    spec = types.SimpleNamespace(num_hidden_layers=4, layer_ids=(1, 2, 3, 4), target_top_k=None, hidden_size=64,
                                 vocab_size=head.vocab_size, model=target)
    Eagle3Drafter.for_run(spec, head, 3, draft_vocab_size=48).save_pretrained(out, verifier=target)
    return out


def test_a_draft_for_another_target_is_refused_in_one_line_before_ray_starts(serve_model, tmp_path, capsys):
    """A --speculative-config head trained for another target, or `mtp` on a folder that declares MTP layers without
    their tensors, failed only when the replica loaded it (83 s, 201 lines): refused before Ray, exit 2."""
    import json

    from reference.tiny_models import build_tiny_model

    head = _eagle3_head(serve_model, str(tmp_path / "head"))
    wide = build_tiny_model("llama", str(tmp_path / "wide"), hidden_size=96)
    lost = build_tiny_model("deepseek_v3", str(tmp_path / "lost"), kv_lora_rank=32, q_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
                            n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                            num_experts_per_tok=2, moe_intermediate_size=32)
    with open(os.path.join(lost, "config.json")) as f:
        doc = json.load(f)
    with open(os.path.join(lost, "config.json"), "w") as f:  # declared, but the tensors are not in the checkpoint
        json.dump({**doc, "num_nextn_predict_layers": 1}, f)
    cases = [(wide, {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              "reads states 64 wide, the target's are 96: it was trained for another target"),
             (lost, {"method": "mtp", "num_speculative_tokens": 1}, "holds none of their tensors")]
    for model, spec, needle in cases:
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", model, "--speculative-config", json.dumps(spec)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert time.monotonic() - start < 30
    # the same head on its own target passes the check (the server would start)
    from transformers import AutoConfig

    from extractor.config import speculative_config_from_dict
    from serve.server import check_draft_source

    spec, _ = speculative_config_from_dict({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    check_draft_source(spec, serve_model, AutoConfig.from_pretrained(serve_model))
