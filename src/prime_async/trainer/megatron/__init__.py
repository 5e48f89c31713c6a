"""Megatron-core trainer backend (`trainer.backend = "megatron"`, optional extra `megatron`).

Same contract as the FSDP2 backend: the same `RankBatch`es from the orchestrator, the same loss
(`trainer/loss.py::build_loss_fn`) and logprob code (`trainer/packed_rows.py::packed_logprobs`), the same
publisher writing HF safetensors to `broadcasts/step_{n}/`. What differs is the model: a megatron-core
`GPTModel` built from the HF config, split by tensor and pipeline parallelism.

Modules:
- `bridge`  HF <-> megatron names/shapes for Llama, Qwen2, Qwen3 (GQA, q/k norm, qkv bias, tied
            embeddings, fused QKV per query group, [gate; up] per TP rank, vocabulary padding);
- `model`   parallel state, GPTModel (local layer spec), HF weights in, HF weights out;
- `batch`   packed rows -> right-padded (B, S) batches and back (megatron's RoPE ignores position_ids);
- `backend` megatron DDP + distributed optimizer + forward/backward schedule + the shared loss: the
            `TrainBackend` the one trainer loop (`trainer/train.py`) builds for `backend = "megatron"`;
- `cuda_kernels` hides CUDA-only kernel packages that cannot load on this machine from megatron-core.

GPU path (one 8-GPU node): `uv sync --extra megatron --inexact`, then
`torchrun --nproc-per-node 8 -m prime_async.entrypoints.trainer @ configs/gpu/trainer_megatron.toml`
(TP=2 x DP=4 for an 8B model; `trainer_megatron_32b.toml`: TP=4 x PP=2 for a 32B model). NCCL process
groups, bf16 parameters with fp32 main grads, megatron's distributed optimizer. The orchestrator splits each
batch into one share per process; the TP/PP ranks of a replica gather their shares.
`scripts/gpu_smoke_megatron.sh` checks it on a GPU machine.

Limits (checked at config validation): Llama/Qwen2/Qwen3 and Qwen3-MoE (expert parallel at TP = 1: MoE
under TP needs sequence parallelism), no sequence parallelism (needs TransformerEngine specs).
Checkpoints: `checkpoint` (sharded, `megatron.core.dist_checkpointing`, loadable at another layout);
`export-megatron` converts one to an HF directory. Without CUDA the same code runs on CPU ranks over gloo
(`cpu_ranks`): `uv run rl @ configs/tiny/rl_megatron.toml`.

Importing this package first runs `cuda_kernels.hide_unloadable_kernels()`: CUDA-only kernels that the
`sglang` extra installs (`flash_mla`) raise OSError on a machine without the CUDA driver, which
megatron-core's import does not survive; hidden, they look absent to it, so both extras share one
environment.
"""

from prime_async.trainer.megatron.cuda_kernels import hide_unloadable_kernels

hide_unloadable_kernels()
