"""The plan key (jobs.plan.plan_key): what lets a finished run's re-run be answered without loading the model. It must
change with anything that could change the plan, and be "" where nothing cheap keys it (the full check runs then)."""

from __future__ import annotations

import dataclasses
import os
import shutil

from corpus.readers import CorpusFile
from harness.corpora import write_jsonl
from jobs.config import JobConfig
from jobs.plan import plan_key


def _job(tmp_path, tiny_llama):
    model = str(tmp_path / "model")
    shutil.copytree(tiny_llama, model)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "prompt": "one two"}])
    config = JobConfig(model=model, corpus=(corpus,), output=str(tmp_path / "out"))
    return config, [CorpusFile(corpus, "jsonl")]


def test_the_plan_key_is_stable_and_moves_with_settings_model_files_corpus_files_and_versions(tmp_path, tiny_llama,
                                                                                            monkeypatch):
    config, files = _job(tmp_path, tiny_llama)
    key = plan_key(config, files)
    assert len(key) == 64 and plan_key(config, files) == key
    assert plan_key(dataclasses.replace(config, layers=(1, 2)), files) != key
    assert plan_key(dataclasses.replace(config, max_tokens=2), files) != key
    with open(os.path.join(config.model, "tokenizer_config.json"), "a") as f:  # a tokenizer file edited
        f.write(" ")
    edited = plan_key(config, files)
    assert edited != key
    config_json = os.path.join(config.model, "config.json")
    st = os.stat(config_json)
    os.utime(config_json, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten with the same size
    assert plan_key(config, files) != edited
    edited = plan_key(config, files)
    with open(os.path.join(config.model, "extra.safetensors"), "wb") as f:  # a file added to the model folder
        f.write(b"x")
    assert plan_key(config, files) != edited
    edited = plan_key(config, files)
    with open(files[0].url, "a") as f:  # a record appended to the corpus
        f.write('{"id": "b", "prompt": "three"}\n')
    assert plan_key(config, files) != edited
    edited = plan_key(config, files)
    import jobs.plan as plan_module

    monkeypatch.setattr(plan_module, "version", lambda package: "0.0-other")  # another transformers, torch, hsx
    assert plan_key(config, files) != edited


def test_no_plan_key_where_nothing_cheap_keys_the_job(tmp_path, tiny_llama):
    config, files = _job(tmp_path, tiny_llama)
    assert plan_key(config, [CorpusFile("s3://bucket/c.jsonl", "jsonl")]) == ""  # a corpus not on local disk
    assert plan_key(dataclasses.replace(config, model="org/model-on-the-hub"), files) == ""
    assert plan_key(dataclasses.replace(config, chat_template=str(tmp_path / "missing.jinja")), files) == ""


def test_where_a_job_runs_and_how_it_reports_leave_the_key_and_a_dangling_link_gives_none(tmp_path, tiny_llama):
    config, files = _job(tmp_path, tiny_llama)
    key = plan_key(config, files)
    elsewhere = dataclasses.replace(config, workers=3, progress=False, verbose=True, break_lease=True,
                                    storage_options={"key": "rotated-credential"})
    assert plan_key(elsewhere, files) == key
    os.symlink(str(tmp_path / "gone"), os.path.join(config.model, ".#config.json"))  # an editor's lock link
    assert plan_key(config, files) == ""  # not a traceback: the full planning runs


def test_a_drafter_plug_in_installed_changes_the_key(tmp_path, tiny_llama, monkeypatch):
    """The default layers come from every registered drafter family: a new plug-in may change the plan."""
    from importlib.metadata import EntryPoint

    import jobs.plan as plan_module

    config, files = _job(tmp_path, tiny_llama)
    key = plan_key(config, files)
    real = plan_module.declared
    extra = EntryPoint("mine", "my_drafters:FAMILY", "hsx.drafters")
    monkeypatch.setattr(plan_module, "declared",
                        lambda group: [*real(group), *([extra] if group == "hsx.drafters" else [])])
    assert plan_key(config, files) != key
