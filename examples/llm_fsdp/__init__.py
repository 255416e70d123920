"""llm_fsdp: a small decoder-only transformer trained with FSDP2 on CPU (gloo), checkpointed
with torch.distributed.checkpoint through trainguard's agent.

Modules: :mod:`~examples.llm_fsdp.model` (RMSNorm, causal attention, SwiGLU blocks) and
:mod:`~examples.llm_fsdp.train` (the entry point, run with ``trainguard run ... -m
examples.llm_fsdp.train``). The data (standard-library bytes as fixed windows), the sample
ledger and the parameter digest are :mod:`examples.charlm`'s.
"""

__all__: list[str] = []
