"""specheads inside vLLM: the proposer vLLM drafts with (:mod:`.proposer`, ``specheads.vllm.proposer.Proposer``),
the serving settings (:mod:`.options`), and the child processes the tool starts in vLLM's own Python: decoding
(:mod:`.run`), the cost profile (:mod:`.profile`), datagen's generation (:mod:`.jobs`), swap mining's server
(:mod:`.serve`) and the target's hidden states (:mod:`.states`, :mod:`.states_child`)."""
