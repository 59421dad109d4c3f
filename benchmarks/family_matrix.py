"""The target-family coverage matrix: every family of reference.tiny_models through every column, against transformers.

    python benchmarks/family_matrix.py [--families a,b] [--columns c,d] [--write docs/families.md]

Each family is a tiny random model built locally from transformers' own config class (no downloads), its norms given
random weights so that a wrong norm shows. Columns (each an independent oracle: a plain transformers forward or
`generate`, never hsx):
    states      ids 0, 1 and N (pre-norm) of three prompts of different lengths, extracted by hsx's offline API
                (chunked prefill, 8-token chunks), equal transformers' forward
    packed      the same prompts prompt-only in one forward: packed end to end (extractor.packing) where hsx packs
                the family, equal transformers' forward of each prompt alone; "padded: why" where packing would not
                be exact and the engine pads instead
    final_norm  FinalNorm.from_model_dir (weights read from the checkpoint alone) turns the pre-norm N into
                transformers' last_hidden_state
    top_k       the top-k target (`target="top_k:8"`) equals transformers' log_softmax(logits) top 8
    generation  greedy decoding of the three prompts together (different lengths, chunked prefill) equals
                `generate` of each, token for token
    ngram       speculative decoding with ngram drafts (k = 3) equals `generate`; some drafts were rejected
    eagle3      speculative decoding with an EAGLE-3 head (k = 3, trained 30 steps on the target's own greedy run)
                equals `generate`; some drafts were rejected
    verify      the states hsx's engine extracts, stored as a run by hsx's connector, pass `hsx verify --all
                --recompute 3` (headers, checksums, and a transformers forward of each sample)
A family a column cannot run on gets the one-line reason hsx gives ("refused: ...") — never a wrong result.
tests/extractor/test_family_matrix.py runs the same checks in the suite; docs/families.md is this script's output.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reference.tiny_models import FAMILIES, build_tiny_model, randomise_norms  # noqa: E402

COLUMNS = ("states", "packed", "final_norm", "top_k", "generation", "ngram", "eagle3", "verify")
SLOW_COLUMNS = ("eagle3", "verify")
NEW_TOKENS = 32
CHUNK = 8
K = 3


class Refused(Exception):
    """hsx refuses the column for this family with a one-line reason (not a failure)."""


def prompts(vocab: int) -> list[list[int]]:
    """Three prompts of different lengths with repeats in them (so ngram drafts are made), ids away from the
    special tokens."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(5, vocab, (6,), generator=g).tolist()
    return [base * 3 + [7, 9], (base[:4] * 4)[:13], base[:3] * 2]


def build(family: str, out: str) -> str:
    """The family's tiny model at `out`, its norm weights randomised (a fresh model's are all 1 or all 0)."""
    return randomise_norms(build_tiny_model(family, out))


def reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every row runs to max_new_tokens, as ignore_eos does in hsx
    return model


def _oracle_states(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(hidden states 0..N-1 and the pre-norm N, each [T, H]; transformers' last_hidden_state [T, H]) of one
    standalone forward. Pre-norm N: the last decoder layer's output, hooked where transformers keeps the layers."""
    holders = [getattr(model, "model", None), getattr(model, "transformer", None), model.base_model]
    layers = next(getattr(h, name) for h in holders if h is not None for name in ("layers", "h") if hasattr(h, name))
    seen = {}
    handle = layers[-1].register_forward_hook(lambda m, a, out: seen.update(last=out[0] if isinstance(out, tuple)
                                                                            else out))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    return [h[0] for h in out.hidden_states[:-1]] + [seen["last"][0]], out.hidden_states[-1][0]


def _greedy(model, rows: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    out = []
    for ids in rows:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=3)
        out.append(seq[0, len(ids):].tolist())
    return out


def _llm(**kwargs):
    """hsx's offline engine; its one-line refusal (ValueError) becomes the cell's "refused: ..."."""
    from extractor import LLM

    try:
        return LLM(**kwargs)
    except ValueError as e:
        raise Refused(str(e)) from None


def _stored_states(model_dir: str, model, tmp: str, max_tokens: int, **engine) -> tuple[str, object]:
    """(the worst relative difference, the engine) of ids 0, 1 and N that hsx's offline API stores for the three
    prompts, each against transformers' forward of it alone."""
    from connectors import KVTransferConfig, example_hidden_states_connector
    from extractor import SamplingParams

    n = model.config.get_text_config().num_hidden_layers
    layer_ids = [0, 1, n]
    llm = _llm(model=model_dir, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": tmp}), **engine)
    worst = 0.0
    rows = prompts(model.config.get_text_config().vocab_size)
    outputs = llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=max_tokens))
    for ids, output in zip(rows, outputs):
        got = example_hidden_states_connector.load_hidden_states(output.kv_transfer_params["hidden_states_path"])
        assert got["token_ids"].tolist() == ids
        states, _ = _oracle_states(model, ids)
        want = torch.stack([states[i] for i in layer_ids], 1)  # [T, 3, H]
        rel = ((got["hidden_states"].float() - want).norm() / want.norm()).item()
        assert rel < 1e-5, f"states differ from transformers' forward by {rel:.2e} (relative)"
        worst = max(worst, rel)
    return f"{worst:.0e}", llm


def check_states(model_dir: str, model, tmp: str) -> str:
    return _stored_states(model_dir, model, tmp, 1, max_num_batched_tokens=CHUNK)[0]


def check_packed(model_dir: str, model, tmp: str) -> str:
    worst, llm = _stored_states(model_dir, model, tmp, 0, max_num_batched_tokens=256)
    why = llm.runner.packing_refusal
    return worst if why is None else f"padded: {why}"


def check_final_norm(model_dir: str, model, tmp: str) -> str:
    from extractor.norm import FinalNorm

    norm = FinalNorm.from_model_dir(model_dir)
    states, last_hidden = _oracle_states(model, prompts(model.config.get_text_config().vocab_size)[0])
    got = norm(states[-1])
    assert torch.allclose(got, last_hidden, rtol=1e-5, atol=1e-5), (got - last_hidden).abs().max().item()
    return type(norm.module).__name__


def check_top_k(model_dir: str, model, tmp: str) -> str:
    from connectors import KVTransferConfig, example_hidden_states_connector
    from connectors.format import TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
    from extractor import SamplingParams

    llm = _llm(model=model_dir, target="top_k:8", speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}}},
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": tmp}))
    ids = prompts(model.config.get_text_config().vocab_size)[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))[0]
    got = example_hidden_states_connector.load_hidden_states(out.kv_transfer_params["hidden_states_path"])
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1).topk(8)
    assert torch.equal(got[TARGET_TOPK_IDS].long(), want.indices), "top-k ids differ from transformers' logits"
    assert torch.allclose(got[TARGET_TOPK_LOGPROBS], want.values, atol=1e-4)
    return "equal"


def _decode(model_dir: str, model, speculative_config: dict | None) -> tuple[str, dict]:
    from extractor import SamplingParams

    rows = prompts(model.config.get_text_config().vocab_size)
    llm = _llm(model=model_dir, max_num_batched_tokens=CHUNK, speculative_config=speculative_config)
    outs = llm.generate([{"prompt_token_ids": r} for r in rows],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = _greedy(model, rows)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)}"
    return "equal", llm.stats.__dict__


def check_generation(model_dir: str, model, tmp: str) -> str:
    return _decode(model_dir, model, None)[0]


def _speculative(model_dir: str, model, config: dict) -> str:
    _, stats = _decode(model_dir, model, config)
    drafted, accepted = stats["num_draft_tokens"], stats["num_accepted_tokens"]
    assert drafted > accepted, f"no draft was rejected ({accepted} of {drafted} accepted): rollback untested"
    return f"lossless, {accepted}/{drafted} accepted"


def check_ngram(model_dir: str, model, tmp: str) -> str:
    return _speculative(model_dir, model, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                           "prompt_lookup_min": 1})


def check_eagle3(model_dir: str, model, tmp: str, steps: int = 30) -> str:
    """An EAGLE-3 head trained `steps` AdamW steps on a run of the prompts + the target's greedy continuations
    (aux layers 1, 2, 3 and N, states from transformers' forward), then decoded by hsx's engine."""
    from connectors import HiddenStatesSpec
    from drafters.base import DrafterBatch, TargetHead
    from drafters.registry import drafter_class
    from extractor.rollback import refuse_state_space_only, rollback_plan
    from harness.runs import Sample, write_run
    from training import HiddenStatesDataset, PackCollator

    try:  # the engine's refusals first: no head is trained for a target hsx will not decode speculatively
        refuse_state_space_only(model)
        rollback_plan(model, 4096)
    except ValueError as e:
        raise Refused(str(e)) from None
    text = model.config.get_text_config()
    n = int(text.num_hidden_layers)
    layers = (1, 2, 3, n)
    rows = prompts(text.vocab_size)
    samples = []
    for i, (ids, cont) in enumerate(zip(rows, _greedy(model, rows))):
        full = ids + cont
        states, _ = _oracle_states(model, full)
        samples.append(Sample(f"g{i}", torch.tensor(full), torch.stack([states[k] for k in layers], 1).contiguous(),
                              torch.ones(len(full), dtype=torch.uint8)))
    run = os.path.join(tmp, "run")
    write_run(run, samples, HiddenStatesSpec(layer_ids=layers, num_hidden_layers=n, hidden_size=int(text.hidden_size),
                                             dtype="float32", model=model_dir))
    ds = HiddenStatesDataset(run)
    target = TargetHead.from_model_dir(model_dir)
    torch.manual_seed(0)
    drafter = drafter_class("eagle3").for_run(ds.run_info, target, K, draft_vocab_size=64)
    drafter.prepare(ds)
    batch = DrafterBatch.from_packed(PackCollator(256)([ds[i] for i in range(len(ds))]), ds.run_info.layer_ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = drafter.training_step(batch, target).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    head = os.path.join(tmp, "eagle3")
    drafter.eval().save_pretrained(head, verifier=model_dir)
    return _speculative(model_dir, model, {"method": "eagle3", "model": head, "num_speculative_tokens": K})


def check_verify(model_dir: str, model, tmp: str) -> str:
    from cli.main import main
    from connectors import HiddenStatesSpec, KVTransferConfig, example_hidden_states_connector
    from extractor import SamplingParams
    from harness.runs import Sample, write_run

    text = model.config.get_text_config()
    n = int(text.num_hidden_layers)
    layers = (1, n)
    llm = _llm(model=model_dir, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}},
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": os.path.join(tmp, "x")}))
    rows = prompts(text.vocab_size)
    samples = []
    for i, out in enumerate(llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=1))):
        got = example_hidden_states_connector.load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        samples.append(Sample(f"s{i}", got["token_ids"], got["hidden_states"],
                              torch.ones(len(got["token_ids"]), dtype=torch.uint8)))
    run = os.path.join(tmp, "run")
    write_run(run, samples, HiddenStatesSpec(layer_ids=layers, num_hidden_layers=n, hidden_size=int(text.hidden_size),
                                             dtype="float32", model=model_dir))
    code = main(["verify", run, "--all", "--recompute", str(len(samples))])
    assert code == 0, f"hsx verify exited {code}"
    return "passes"


CHECKS = {"states": check_states, "packed": check_packed, "final_norm": check_final_norm, "top_k": check_top_k,
          "generation": check_generation, "ngram": check_ngram, "eagle3": check_eagle3, "verify": check_verify}


def run_cell(family: str, column: str, model_dir: str, model) -> str:
    """The column's result for the family ("refused: ..." where hsx refuses it); AssertionError when wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return CHECKS[column](model_dir, model, tmp)
        except Refused as e:
            return f"refused: {e}"


def matrix(families, columns, log=print) -> dict[str, dict[str, str]]:
    results: dict[str, dict[str, str]] = {}
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build(family, os.path.join(tmp, family))
            model = reference(model_dir)
            results[family] = {}
            for column in columns:
                t0 = time.perf_counter()
                try:
                    results[family][column] = run_cell(family, column, model_dir, model)
                except AssertionError as e:
                    results[family][column] = f"FAILS: {e}"
                log(f"{family:14s} {column:11s} {results[family][column]}  ({time.perf_counter() - t0:.1f} s)")
    return results


def markdown(results: dict[str, dict[str, str]], columns) -> str:
    import transformers

    lines = [f"| family | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for family, row in results.items():
        cells = [row.get(c, "-").replace("|", "/") for c in columns]
        lines.append(f"| {family} | {' | '.join(cells)} |")
    return (f"Generated by `python benchmarks/family_matrix.py --write docs/families.md` (transformers "
            f"{transformers.__version__}, torch {torch.__version__}, CPU, float32). Do not edit by hand.\n\n"
            + "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--write", help="replace the generated table in this markdown file (between its markers); with "
                                    "some --columns only, the file's cells of the other columns are kept")
    args = ap.parse_args(argv)
    families, columns = args.families.split(","), args.columns.split(",")
    results = matrix(families, columns)
    if args.write:
        kept = read_table(args.write) if os.path.exists(args.write) and set(columns) != set(COLUMNS) else {}
        merged = {f: {c: results.get(f, {}).get(c) or kept.get(f, {}).get(c, "-") for c in COLUMNS}
                  for f in (FAMILIES if kept else families)}
        write_table(args.write, markdown(merged, COLUMNS if kept else columns))
    else:
        print(markdown(results, columns))
    return 1 if any(v.startswith("FAILS") for row in results.values() for v in row.values()) else 0


BEGIN, END = "<!-- family_matrix: begin -->", "<!-- family_matrix: end -->"


def read_table(path: str) -> dict[str, dict[str, str]]:
    """family -> {column: cell} of the generated table in a markdown file."""
    with open(path) as f:
        table = f.read().split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table.splitlines()
            if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in body}


def write_table(path: str, table: str) -> None:
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{table}{END}{tail}")


if __name__ == "__main__":
    raise SystemExit(main())
