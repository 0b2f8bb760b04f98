"""The model card of a heads-export format=speculators directory."""

from __future__ import annotations


def card(cfg: dict) -> str:
    """A short README.md: what the directory is and how vLLM loads it."""
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    target = cfg["speculators_config"]["verifier"]["name_or_path"] or "TARGET"
    return "\n".join(
        [
            "---",
            "library_name: specheads",
            "tags:",
            "- speculative-decoding",
            "- eagle3",
            "- speculators",
            "---",
            "",
            "# specheads EAGLE-3 draft head (speculators format)",
            "",
            f"One Llama decoder layer over the target's states at layers {cfg['eagle_aux_hidden_state_layer_ids']}, "
            f"output layer over {cfg['draft_vocab_size']} of the target's "
            f"{cfg['transformer_layer_config']['vocab_size']} "
            "tokens; the token embedding is the target's (not stored: vLLM shares it).",
            "",
            "```python",
            "from vllm import LLM",
            f'llm = LLM(model={target!r}, speculative_config={{"method": "eagle3", '
            f'"model": "THIS_DIRECTORY", "num_speculative_tokens": {k}}})',
            "```",
            "",
        ]
    )
