"""Hooks a server needs from the engine: abort_request, typed error kinds, write timings, forgetting a removed file."""

from __future__ import annotations

import os

import pytest
import torch

from connectors import KVTransferConfig, cleanup_hidden_states, load_hidden_states
from extractor import LLM, SamplingParams
from extractor.runner import ModelRunner
from tests.extractor.oracle import load_reference, stop_string_cut

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 11, [100, 3, 250, 61], [12, 13], [99, 98, 97]]


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _llm(model_dir, root, **kw):
    return LLM(model=model_dir, dtype="float32", kv_transfer_config=KVTransferConfig(
        kv_connector_extra_config={"shared_storage_path": str(root), "allow_custom_save_path": True}), **kw)


def test_aborted_requests_stop_write_nothing_and_the_others_are_exact(tiny_llama, tmp_path, monkeypatch):
    model, _ = load_reference(tiny_llama)
    llm = _llm(tiny_llama, tmp_path, max_num_seqs=2)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    real_decode, steps = ModelRunner.decode, []

    def decode(runner, state, tokens, capture, **kwargs):  # what another thread would do, at a known step
        steps.append(len(tokens))
        if len(steps) == 3:
            llm.abort_request(["r0", "r5", "no-such-request"])  # r0 is running (longest first: r2, r0), r5 waits
        return real_decode(runner, state, tokens, capture, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", decode)
    llm._scheduler.outputs.block = 2  # r0 has handed rows over to the connector when it is aborted
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                       extra_args={"kv_transfer_params": {"include_output_tokens": True}}),
                        request_ids=ids)
    by_id = {o.request_id: o for o in outs}
    for rid in ("r0", "r5"):
        assert by_id[rid].error_kind == "aborted" and by_id[rid].kv_transfer_params is None
        assert not os.path.exists(tmp_path / f"{rid}.safetensors")
    assert len(by_id["r0"].outputs[0].token_ids) < 8 and by_id["r5"].outputs[0].token_ids == []
    for rid, p in zip(ids, PROMPTS):
        if rid not in ("r0", "r5"):
            out = by_id[rid]
            assert out.error is None and out.outputs[0].token_ids == hf_greedy(model, p, 8)
            stored = load_hidden_states(out.kv_transfer_params["hidden_states_path"])["token_ids"].tolist()
            assert stored == p + out.outputs[0].token_ids[:-1]
            assert out.write_seconds is not None and out.write_seconds >= 0
    assert llm._scheduler.outputs._rows == {}  # nothing kept for the aborted requests
    # an abort of an id no call is running is ignored: the next request with that id runs
    llm.abort_request("r0")
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), request_ids=["r0"])
    assert again[0].error is None
    llm.shutdown()


def test_errors_say_their_kind_and_a_forgotten_file_may_be_written_again(tiny_llama, tmp_path):
    llm = _llm(tiny_llama, tmp_path)
    custom = str(tmp_path / "mine.safetensors")
    kv = {"kv_transfer_params": {"hidden_states_path": custom}}
    outs = llm.generate([{"prompt_token_ids": []}, {"prompt_token_ids": [5, 6]}],
                        [SamplingParams(max_tokens=0), SamplingParams(max_tokens=0, extra_args=kv)])
    assert outs[0].error_kind == "invalid" and "empty" in outs[0].error
    assert outs[1].error is None and outs[1].error_kind is None
    second = llm.generate([{"prompt_token_ids": [7, 8]}], SamplingParams(max_tokens=0, extra_args=kv))[0]
    assert second.error_kind == "path_in_use" and "overwrite" in second.error
    cleanup_hidden_states(custom)
    llm.connector.forget(custom)
    third = llm.generate([{"prompt_token_ids": [7, 8]}], SamplingParams(max_tokens=0, extra_args=kv))[0]
    assert third.error is None and load_hidden_states(custom)["token_ids"].tolist() == [7, 8]
    llm.shutdown()


def test_stop_strings_end_generation_as_vllm_does(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    model, _ = load_reference(tiny_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = [5, 17, 33, 2, 9]
    plain = hf_greedy(model, prompt, 24)
    full = tok.decode(plain, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]  # three characters from the middle of the greedy text
    assert stop.strip() and stop in full
    n = stop_string_cut(tok, plain, stop)  # the oracle: the plain greedy tokens, decoded by prefixes
    cut = tok.decode(plain[:n], skip_special_tokens=True)
    llm = _llm(tiny_llama, tmp_path)
    spec = LLM(model=tiny_llama, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 5})
    for engine in (llm, spec):
        for include in (False, True):
            (out,) = engine.generate([{"prompt_token_ids": prompt}], SamplingParams(
                max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "never-generated"],
                include_stop_str_in_output=include))
            c = out.outputs[0]
            assert c.token_ids == plain[:n] and c.finish_reason == "stop" and c.stop_reason == stop
            assert c.text == (cut[:cut.index(stop) + len(stop)] if include else cut[:cut.index(stop)])
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                          stop_token_ids=[plain[3]]))
    assert out.outputs[0].stop_reason == plain[3] and out.outputs[0].token_ids == plain[:plain.index(plain[3]) + 1]
    llm.shutdown()


def _byte_fallback_tokenizer():
    """A Llama-2-style tokenizer (byte-fallback BPE: <0xNN> tokens, a Replace/ByteFallback/Fuse/Strip decoder), whose
    streaming decoder rewrites text it already gave on some invalid bytes (tokenizers raises there)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    vocab.update({"\u2581": 256, "a": 257, "b": 258, "c": 259, "\u2581c": 260, "x": 261, "<unk>": 262, "</s>": 263})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "c")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("incremental", [True, False], ids=["streamed", "whole-decodes"])
def test_stop_strings_hold_on_byte_fallback_text_that_a_streaming_decoder_cannot_take(tmp_path, incremental):
    # the stop-string search on the text of each new token, against the oracle (decode by prefixes): the streaming
    # decoder raises on 0xC2 0xA1 0xE1 then "\u2581c" (the request falls back to whole decodes, nothing fails), and
    # whole decodes (slow tokenizers) hold a text ending inside a character until it is whole (0xE3 0x80 0x82)
    from extractor.request import Request
    from reference.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path / "m"))
    tok = _byte_fallback_tokenizer()
    tok.save_pretrained(str(tmp_path / "m"))
    llm = LLM(model=str(tmp_path / "m"), dtype="float32")
    llm._stopping._incremental_text = incremental
    for ids, stop in (([0xC2, 0xA1, 0xE1, 260, 257, 258], "ca"), ([261, 0xE3, 0x80, 0x82, 257, 258], "\u3002a")):
        n = stop_string_cut(tok, ids, stop)
        r = Request(0, "r", None, [5], SamplingParams(stop=[stop], temperature=0))
        for t in ids:
            r.output_ids.append(t)
            if llm._stopping._hit_stop_string(r):
                break
        assert (len(r.output_ids), r.stop_hit) == (n, True), (ids, stop)
        out = llm._output(r).outputs[0]
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert out.text == full[:full.index(stop)] and out.stop_reason == stop


def test_a_request_whose_file_cannot_be_handed_over_fails_and_is_not_answered_without_it(tiny_llama, tmp_path,
                                                                                        monkeypatch):
    """The generated rows go to the connector when the request finishes: if that fails (a device out of memory, a
    connector refusal), the request fails with the engine's error and nothing is left in flight, never an answer
    without the file it asked for."""
    from extractor.scheduler import OutputRows

    llm = _llm(tiny_llama, tmp_path)
    real_flush = OutputRows.flush

    def flush(self, request_id):
        if request_id == "broken":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_flush(self, request_id)

    monkeypatch.setattr(OutputRows, "flush", flush)
    include = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], include, request_ids=["broken"])
    assert out.error_kind == "engine" and "out of memory" in out.error and out.kv_transfer_params is None
    assert list(tmp_path.glob("*.safetensors")) == [] and llm.connector._requests == {}
    (again,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], include, request_ids=["fine"])
    assert again.error is None and os.path.exists(again.kv_transfer_params["hidden_states_path"])
    llm.shutdown()


def test_a_target_no_engine_path_builds_is_one_line_naming_what_hsx_runs(tmp_path, capsys):
    """A LLaVA-style target (no causal LM class in transformers, not a vision-language family hsx runs) failed with
    transformers' list of 200 config classes, in a Ray worker after 40 s: one line, before anything loads."""
    import transformers

    from cli.main import main
    from reference.tiny_models import build_tokenizer

    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=600)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    folder = str(tmp_path / "llava")
    transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict()).save_pretrained(folder)
    build_tokenizer(folder)
    with pytest.raises(ValueError) as e:
        LLM(model=folder)
    message = str(e.value)
    assert "is a llava target, for which transformers has no causal LM class" in message
    assert "qwen2_5_vl" in message and "\n" not in message and len(message.replace(folder, "MODEL")) < 400
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "x y z"}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", folder, "--corpus", str(corpus), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is a llava target" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
