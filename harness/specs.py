"""Engine settings tests and benchmarks build often."""


def spec_config(layer_ids):
    """The speculative_config of the extract_hidden_states pseudo-drafter capturing `layer_ids` (vLLM's shape)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
