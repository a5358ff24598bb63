"""Train a small Llama with tensor parallelism run by hostir.

Hugging Face's `LlamaForCausalLM` (a small config, random weights: nothing
is downloaded) is parallelized with the model's own tensor-parallel plan
through `hostir.parallel.parallelize_module`, the drop-in for torch's: the
attention and MLP projections become DTensor parameters, and each of them
runs forward and backward as a hostir program with its communications. The
optimizer is torch's. Rank 0 prints the loss of every step.

Run it on every rank, on CPU (gloo) or GPUs (NCCL), unchanged:

    mpirun -np 2 python3 examples/train_llama_tp.py
    torchrun --nproc-per-node 4 examples/train_llama_tp.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hostir
from hostir.parallel import parallelize_module

STEPS, BATCH, SEQUENCE = 5, 4, 32


def main() -> None:
    d, rank, local = hostir.world_size(), hostir.rank(), hostir.local_rank()
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = hostir.DeviceMesh(range(d)).to_torch(device.type)

    # Every rank builds the same model and data from the same seed.
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQUENCE,
    )
    model = LlamaForCausalLM(config).to(device)
    parallelize_module(model.model, mesh, dict(config.base_model_tp_plan))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQUENCE), device=device)

    for step in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if rank == 0:
        print(f"trained {STEPS} steps on {d} rank(s), {device.type}")


if __name__ == "__main__":
    main()
