"""vLLM's own hidden states, recorded inside its worker as its model hands them to the extract_hidden_states
pseudo-drafter, before the hidden-state cache or any hsx code sees them: the record hsx's files are checked against.

    LLM(..., worker_extension_cls=EXTENSION)        vLLM mixes Recorder into its worker class
    llm.collective_rpc("record_states")             each worker wraps its pseudo-drafter's propose (once)
    recorded(llm, request_id) -> (positions [n], states [n, L, H])   rank 0's record of that request, forgotten
                                                       once taken; a position computed again (a rejected draft's)
                                                       keeps its last computation, as its cache slot does

Rows are keyed by vLLM's request id and the token's position (seq_len - query_len + i within the request's query),
never by cache slot, so a wrong slot or block mapping in the plug-in cannot agree with this record by accident.
Layers in vLLM's capture order (ascending ids).
"""

from __future__ import annotations

EXTENSION = "tests.vllm_engine.vllm_capture.Recorder"


class Recorder:
    """Mixed into vLLM's worker (`self` is the worker)."""

    def record_states(self) -> None:
        import torch

        runner = self.model_runner
        drafter = runner.drafter
        if getattr(drafter, "hsx_record", None) is not None:
            return
        record: dict[tuple[str, int], torch.Tensor] = {}
        propose = drafter.propose

        def recording(*args, **kwargs):
            meta = kwargs["common_attn_metadata"]
            rows = torch.stack(kwargs["target_hidden_states"], dim=1)  # [N, L, H], the step's tokens in batch order
            starts = meta.query_start_loc_cpu.tolist()
            seq_lens = meta.seq_lens.cpu().tolist()
            for i, rid in enumerate(runner.input_batch.req_ids[:meta.num_reqs]):
                first, last = starts[i], starts[i + 1]
                for j in range(first, last):
                    record[(rid, seq_lens[i] - (last - first) + (j - first))] = rows[j].to("cpu", copy=True)
            return propose(*args, **kwargs)

        drafter.propose = recording
        drafter.hsx_record = record

    def recorded_states(self, request_id: str):
        """The request's record; `request_id` as LLM.generate returns it (vLLM's engine adds "-" and a random
        suffix to the ids it is given)."""
        import torch

        record = self.model_runner.drafter.hsx_record
        keys = sorted((k for k in record if k[0] == request_id or k[0].rsplit("-", 1)[0] == request_id),
                      key=lambda k: k[1])
        if len({rid for rid, _ in keys}) > 1:
            raise ValueError(f"request id {request_id!r} names several requests: {sorted({r for r, _ in keys})}")
        rows = torch.stack([record.pop(k) for k in keys]) if keys else torch.empty(0, 0, 0)
        # bytes, not a tensor: vLLM's RPC reply encoder sends a tensor nested in a tuple as an undecoded list
        return [pos for _, pos in keys], list(rows.shape), str(rows.dtype).removeprefix("torch."), \
            rows.contiguous().numpy().tobytes()


def recorded(llm, request_id: str):
    """(positions, states [n, L, H]) vLLM's rank-0 worker computed for the request (see Recorder.recorded_states)."""
    import torch

    positions, shape, dtype, data = llm.collective_rpc("recorded_states", args=(request_id,))[0]
    states = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
    return positions, states
