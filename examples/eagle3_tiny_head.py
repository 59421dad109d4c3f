"""Worked example: extract hidden states from a tiny model, open them as a dataset, train an EAGLE-3-style head.

    python examples/eagle3_tiny_head.py [--workdir DIR] [--samples 64] [--steps 150]

1. builds a random 8-layer Llama + tokenizer locally (no downloads),
2. extracts EAGLE-3's layers — aux ids [2, N/2, N-3] and the last layer N (pre-norm, vLLM's convention) — with the
   hsx engine and the safetensors connector, then writes the run's run.json and manifest/ through connectors.run
   (what `hsx run` writes for a real corpus),
3. opens the run with HiddenStatesDataset(layout="eagle3", normalize_last_layer=True): aux_hidden_states [T, 3H],
   target_hidden_states [T, H] after the model's final norm,
4. trains a single decoder layer over fc(aux states) + the next token's embedding to predict the next target
   hidden state and the target's next-token distribution, and prints the loss going down.

It documents the data contract; it is not a trainer (no RoPE, no test-time-training unroll, no draft vocabulary).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from connectors import KVTransferConfig
from connectors.manifest import OK, new_attempt_id, write_manifest_part
from connectors.run import RunSpec, data_path, write_run_spec
from training.collate import PadCollator
from training.dataset import HiddenStatesDataset


def extract(model_dir: str, output: str, num_samples: int, seed: int) -> None:
    """Write run.json, run the engine over generated prompts (files under OUTPUT/data/), commit the manifest."""
    from transformers import AutoConfig, AutoTokenizer

    from extractor import LLM, SamplingParams
    from extractor.layers import default_layer_ids
    from reference.tiny_models import sample_text

    layer_ids = list(default_layer_ids(AutoConfig.from_pretrained(model_dir).num_hidden_layers))  # [2, N/2, N-3, N]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=model_dir, dtype="float32",
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
              kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector",
                                                  kv_connector_extra_config={"shared_storage_path": output,
                                                                             "allow_custom_save_path": True}))
    # run.json before any data file, as `hsx run` writes it when a run starts: the engine's own file spec
    write_run_spec(output, RunSpec(llm.spec))
    prompts, params, rows = [], [], []
    for i, text in enumerate(sample_text(num_samples, seed=seed, min_words=8, max_words=40)):
        ids = tokenizer(text).input_ids
        mask = [0] * min(3, len(ids) - 1) + [1] * (len(ids) - min(3, len(ids) - 1))  # learn all but a short prefix
        sid = f"sample-{i:05d}"
        rel = data_path(sid)  # OUTPUT/data/<2 hex>/<sid>.safetensors, as `hsx run` names it
        prompts.append({"prompt_token_ids": ids, "loss_mask": mask, "sample_id": sid})
        params.append(SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {"hidden_states_path": rel}}))
        rows.append({"sample_id": sid, "path": rel, "num_tokens": len(ids), "num_prompt_tokens": len(ids),
                     "status": OK, "bytes": 0})
    outputs = llm.generate(prompts, params)
    for row, out in zip(rows, outputs):
        path = out.kv_transfer_params["hidden_states_path"]
        row["bytes"] = os.path.getsize(path)
    # the data files are durable: commit the manifest part that makes them count
    write_manifest_part(output, rows, attempt=new_attempt_id(), seq=0)


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention + MLP (no positional encoding: enough for a demo)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # [B, 1, T, T]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, T, H/heads]
        x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.mlp_norm(x))


class TinyEagle3Head(nn.Module):
    """EAGLE-3's shape in miniature: fc fuses the aux layers, one decoder layer, the target's frozen LM head."""

    def __init__(self, hidden: int, num_aux: int, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)  # [3H] -> [H]
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.inp = nn.Linear(2 * hidden, hidden, bias=False)  # [fused aux ; next token embedding] -> [H]
        self.layer = DecoderLayer(hidden, heads=4)
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor):
        x = self.inp(torch.cat([self.fc(aux), self.embed(next_ids)], dim=-1))  # [B, T, H]
        h = self.layer(x, attention_mask)  # predicted next target state
        return h, self.lm_head(self.norm(h))  # [B, T, H], [B, T, V]


def train(output: str, model_dir: str, steps: int, batch_size: int, seed: int) -> list[float]:
    from safetensors import safe_open

    torch.manual_seed(seed)
    ds = HiddenStatesDataset(output, layout="eagle3", normalize_last_layer=True, model_dir=model_dir)
    print(ds)
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        embed, lm_head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    hidden = ds.run_info.hidden_size
    head = TinyEagle3Head(hidden, len(ds.run_info.layer_ids) - 1, embed, lm_head)
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, collate_fn=PadCollator(), num_workers=0,
                        generator=torch.Generator().manual_seed(seed))
    losses, step = [], 0
    while step < steps:
        for batch in loader:
            aux, target = batch["aux_hidden_states"], batch["target_hidden_states"]  # [B, T, 3H], [B, T, H]
            ids, att, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]  # [B, T] each
            # position t sees aux states of t and token t+1, and predicts the target state (and token) at t+1
            pred, logits = head(aux[:, :-1], ids[:, 1:], att[:, :-1])
            want = target[:, 1:]
            keep = (att[:, 1:] * lm[:, 1:]).float()  # [B, T-1]
            with torch.no_grad():
                soft = F.softmax(head.lm_head(want), dim=-1)  # the target's next-token distribution
            state_loss = (F.smooth_l1_loss(pred, want, reduction="none").mean(-1) * keep).sum() / keep.sum()
            # KL(target || draft) over the next token: 0 when the draft matches the target's distribution
            kl = F.kl_div(F.log_softmax(logits, -1), soft, reduction="none").sum(-1)  # [B, T-1]
            token_loss = (kl * keep).sum() / keep.sum()
            loss = state_loss + token_loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
            if step % 25 == 0 or step == steps - 1:
                agree = ((logits.argmax(-1) == soft.argmax(-1)).float() * keep).sum() / keep.sum()
                print(f"step {step:4d}  loss {loss.item():.4f} (state {state_loss.item():.4f}, token KL "
                      f"{token_loss.item():.4f})  top-1 agreement with the target {agree.item():.2%}")
            step += 1
            if step == steps:
                break
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="where the model and run go (default: a temp folder)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from reference.tiny_models import build_tiny_model

    workdir = args.workdir or tempfile.mkdtemp(prefix="hsx-eagle3-")
    model_dir = build_tiny_model("llama", os.path.join(workdir, "model"), num_hidden_layers=8)
    output = os.path.join(workdir, "run")
    extract(model_dir, output, args.samples, args.seed)
    print(f"extracted {args.samples} samples into {output}")
    losses = train(output, model_dir, args.steps, args.batch_size, args.seed)
    head, tail = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    print(f"mean loss of the first 10 steps {head:.4f} -> last 10 steps {tail:.4f}")
    return losses


if __name__ == "__main__":
    main()
