"""Writes land only where they were allowed, when they happen: a folder swapped for a symlink after a request was
accepted is refused at write time (nothing written anywhere), names under the root are replaced rather than followed,
and no request silently overwrites another request's file."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from connectors import KVTransferConfig, RequestInfo, load_hidden_states
from connectors.paths import PathInUse
from connectors.safetensors_connector import HiddenStatesConnectorConfig, SafetensorsHiddenStatesConnector
from connectors.storage import UnsafeWritePathError
from tests.connectors.conftest import make_spec


class HeldWriteConnector(SafetensorsHiddenStatesConnector):
    """The real connector, whose background writes wait at a gate the test opens: storage slower than the test.

    Only the start of each background write is held; what runs after the gate is the connector's own write path."""

    def __init__(self, extra_config, spec) -> None:
        super().__init__(extra_config, spec)
        self.gate, self.waiting = threading.Event(), threading.Event()

    def _write(self, *args, **kwargs):
        self.waiting.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super()._write(*args, **kwargs)


@pytest.fixture
def held_connector():
    """make(root) -> a HeldWriteConnector with custom paths allowed; the gate opens and it shuts down after."""
    made = []

    def make(root: str) -> HeldWriteConnector:
        cfg = HiddenStatesConnectorConfig(shared_storage_path=root, allow_custom_save_path=True)
        connector = HeldWriteConnector(cfg, make_spec())
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.gate.set()
        connector.shutdown()


def every_file(top) -> dict[str, str]:
    """Every non-folder under `top`, symlinks not followed: path -> its target (links) or content (files)."""
    out = {}
    for dirpath, dirs, names in os.walk(top):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            out[p] = "-> " + os.readlink(p) if os.path.islink(p) else open(p, "rb").read().hex()
    return out


def start(connector, request_id: str, params: dict, num_tokens: int = 3) -> None:
    connector.start_request(RequestInfo(request_id, num_tokens, params))
    connector.save_hidden_states(request_id, torch.arange(num_tokens), torch.ones(num_tokens, 3, 32))


def swap_for_symlink(folder, target) -> None:
    """What an attacker (or a careless script) does mid-job: the folder goes, a symlink takes its name."""
    shutil.rmtree(folder)
    os.symlink(target, folder)


@pytest.mark.parametrize("swapped", ["sub", "a/b", "a/b/c"], ids=["first-folder", "middle-folder", "last-folder"])
@pytest.mark.parametrize("when", ["before-finish", "while-the-write-waits"])
def test_a_folder_swapped_for_a_symlink_after_the_request_was_accepted_is_refused_and_nothing_is_written(
        swapped, when, tmp_path, held_connector):
    root, outside = tmp_path / "run", tmp_path / "outside"
    rel = "sub/x.safetensors" if swapped == "sub" else "a/b/c/x.safetensors"
    (root / rel).parent.mkdir(parents=True)
    # the outside folder has every folder the rest of the path needs, so following the link would succeed
    (outside / os.path.relpath(root / rel, root / swapped)).parent.mkdir(parents=True)
    connector = held_connector(str(root))
    start(connector, "r", {"hidden_states_path": str(root / rel)})
    if when == "before-finish":
        connector.gate.set()
        swap_for_symlink(root / swapped, outside)
        connector.request_finished("r")
    else:
        connector.request_finished("r")
        assert connector.waiting.wait(30)
        swap_for_symlink(root / swapped, outside)
        connector.gate.set()
    failures = connector.wait_for_save()

    assert list(failures) == ["r"]
    err = failures["r"]
    assert isinstance(err, UnsafeWritePathError) and isinstance(err, PermissionError)
    message = str(err)
    assert str(root / rel) in message and repr(swapped) in message and "symlink" in message
    assert "changed after" in message
    assert every_file(outside) == {}  # neither the file, nor its .lock, nor a temp file
    assert every_file(root) == {str(root / swapped): f"-> {outside}"}


def test_a_file_name_and_lock_name_planted_as_symlinks_are_replaced_inside_the_root_never_followed(
        tmp_path, held_connector):
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim.safetensors").write_bytes(b"precious")
    connector = held_connector(str(root))
    target = root / "sub" / "x.safetensors"
    start(connector, "r", {"hidden_states_path": str(target)})
    connector.request_finished("r")
    assert connector.waiting.wait(30)
    os.symlink(outside / "victim.safetensors", target)  # accepted as a plain name, a symlink by write time
    os.symlink(outside / "planted.lock", str(target) + ".lock")
    connector.gate.set()

    assert connector.wait_for_save() == {}
    assert not os.path.islink(target) and not os.path.lexists(str(target) + ".lock")
    assert torch.equal(load_hidden_states(str(target))["token_ids"], torch.arange(3))
    assert every_file(outside) == {str(outside / "victim.safetensors"): b"precious".hex()}


def test_a_request_with_a_swapped_folder_fails_alone(tmp_path, held_connector):
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    connector = held_connector(str(root))
    start(connector, "doomed", {"hidden_states_path": str(root / "sub" / "x.safetensors")})
    start(connector, "fine", {"hidden_states_path": str(root / "other" / "y.safetensors")})
    start(connector, "default", {})
    for rid in ("doomed", "fine", "default"):
        connector.request_finished(rid)
    swap_for_symlink(root / "sub", outside)
    connector.gate.set()

    assert list(connector.wait_for_save()) == ["doomed"]
    assert sorted(every_file(root)) == sorted([str(root / "sub"), str(root / "other" / "y.safetensors"),
                                               str(root / "default.safetensors")])
    assert every_file(outside) == {}


# -- ownership: one request per file ---------------------------------------------------------------------------------
@pytest.fixture
def llm(tiny_llama, tmp_path):
    from extractor import LLM

    engine = LLM(model=tiny_llama, kv_transfer_config=KVTransferConfig(
        kv_connector="SafetensorsHiddenStatesConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "run"), "allow_custom_save_path": True}))
    yield engine
    engine.shutdown()


def params(path: str, **extra):
    from extractor import SamplingParams

    return SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {"hidden_states_path": path, **extra}})


def test_two_requests_for_one_path_in_one_generate_call_one_succeeds_and_the_other_names_it(llm, tmp_path):
    path = str(tmp_path / "run" / "shared.safetensors")
    first, second = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                                 [params(path), params(path)], request_ids=["first", "second"])

    assert first.error is None and first.kv_transfer_params["hidden_states_path"] == path
    assert second.error is not None and "'first'" in second.error and path in second.error
    assert "overwrite" in second.error
    assert load_hidden_states(path)["token_ids"].tolist() == [5, 6, 7]


def test_a_committed_path_is_refused_to_a_later_request_unless_it_says_overwrite(llm, tmp_path):
    path = str(tmp_path / "run" / "kept.safetensors")
    (done,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], [params(path)], request_ids=["writer"])
    assert done.error is None

    (refused,) = llm.generate([{"prompt_token_ids": [8, 9]}], [params(path)], request_ids=["late"])
    assert refused.error is not None and "'writer'" in refused.error and "overwrite" in refused.error
    assert load_hidden_states(path)["token_ids"].tolist() == [5, 6, 7]

    (replaced,) = llm.generate([{"prompt_token_ids": [8, 9]}], [params(path, overwrite=True)],
                               request_ids=["replacer"])
    assert replaced.error is None
    assert load_hidden_states(path)["token_ids"].tolist() == [8, 9]


def test_overwrite_must_be_a_boolean(llm, tmp_path):
    (out,) = llm.generate([{"prompt_token_ids": [5, 6]}], [params(str(tmp_path / "run" / "a.safetensors"),
                                                                  overwrite="false")])
    assert out.error is not None and "overwrite" in out.error and "'false'" in out.error


def test_requests_that_say_overwrite_are_not_remembered(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path / "run"), allow_custom_save_path=True)
    for i in range(5):
        start(connector, f"r{i}", {"hidden_states_path": f"f{i}.safetensors", "overwrite": True})
        connector.request_finished(f"r{i}")
    start(connector, "kept", {"hidden_states_path": "kept.safetensors"})
    connector.request_finished("kept")
    assert connector.wait_for_save() == {}
    assert connector._owners.num_remembered == 1


def test_default_paths_overwrite_files_that_existed_before_the_connector_started(tmp_path, connector_factory):
    root = tmp_path / "run"
    root.mkdir()
    (root / "old.safetensors").write_bytes(b"left by an earlier run")
    (root / "old.safetensors.lock").write_bytes(b"")  # vLLM leaves its locks behind
    connector = connector_factory(str(root), allow_custom_save_path=True)
    start(connector, "old", {})
    path = connector.request_finished("old")["hidden_states_path"]
    start(connector, "custom", {"hidden_states_path": "mine.safetensors"})
    connector.request_finished("custom")
    assert connector.wait_for_save() == {}

    assert path == str(root / "old.safetensors")
    assert load_hidden_states(path)["token_ids"].tolist() == [0, 1, 2]


def test_a_custom_path_spelled_through_a_symlinked_root_is_the_same_file(tmp_path, connector_factory):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    connector = connector_factory(str(tmp_path / "link"), allow_custom_save_path=True)
    start(connector, "a", {"hidden_states_path": str(tmp_path / "link" / "x.safetensors")})
    with pytest.raises(PathInUse, match="'a'"):
        connector.start_request(RequestInfo("b", 3, {"hidden_states_path": str(real / "x.safetensors")}))
    connector.request_finished("a")
    assert connector.wait_for_save() == {}


def test_a_custom_path_into_a_model_or_a_run_under_an_allowed_root_is_rejected(tmp_path):
    # review finding: `hsx serve --allowed-roots` around a model let a request overwrite its weights (or a run's data
    # file): the start-up check allows a root around the model, so every custom path is checked on its way down
    from connectors.paths import PathPolicy, PathRejected

    model, run = tmp_path / "models" / "llama", tmp_path / "runs" / "r1"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (run / "data" / "3b").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    policy = PathPolicy(str(tmp_path / "out"), [str(tmp_path)])
    for path, what in ((model / "model.safetensors", "a model"), (model / "sub" / "x.safetensors", "a model"),
                       (run / "data" / "3b" / "x.safetensors", "an extraction run")):
        with pytest.raises(PathRejected, match=f"which holds {what}; hsx never writes into a model's or a run's"):
            policy.locate(str(path))
    assert policy.locate(str(tmp_path / "models" / "elsewhere.safetensors")).path.endswith("elsewhere.safetensors")
    assert (model / "model.safetensors").read_bytes() == b"weights"
