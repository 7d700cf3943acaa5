"""Hugging Face Trainer on the ccl backend: a 2-layer GPT-2 built from its config, random tokens.

    torchrun --nproc_per_node 2 examples/hf_trainer.py
    mpirun -n 2 python examples/hf_trainer.py
    torchrun --nproc_per_node 2 examples/hf_trainer.py --backend gloo   # the same run on gloo

    # Transformers <= 4.57 with Accelerate <= 1.12 only: the library creates the group
    CCL_WORKER_COUNT=1 CCL_WORKER_OFFLOAD=0 torchrun --nproc_per_node 2 examples/hf_trainer.py --by-name

Nothing is downloaded: the model is initialised from a config and the data are
random token ids. Needs `transformers` and `accelerate`.

Default path (Transformers 5.x, Accelerate 1.13 and later): these no longer know
the name "ccl": with `TrainingArguments(ddp_backend="ccl", use_cpu=True)` they
raise "Your assigned backend ccl is not available", and without `use_cpu` they
create the group but do not wrap the model in DDP, so the ranks train apart.
They do reuse a process group that already exists: the script creates it first
and leaves `ddp_backend` unset. Under mpirun, importing the bindings fills RANK
and WORLD_SIZE from Intel MPI's variables.

`--by-name` (Transformers 4.57 and older, Accelerate 1.12 and older): the script
passes `ddp_backend=<backend>` and Accelerate creates the group. Accelerate 1.12
only keeps "ccl" on CPU when CCL_WORKER_COUNT is 1 or more (otherwise it raises
"Your assigned backend ccl is not available, please use gloo"); CCL_WORKER_OFFLOAD=0
keeps that worker thread from busy-polling.
"""

import argparse
import gc
import hashlib
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # config-built model: the hub is never needed

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import oneccl_bindings_for_pytorch  # noqa: F401  registers "ccl"; maps mpirun's variables to torch's
import accelerate
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

VOCAB, SEQ = 64, 16


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random sequences; remembers which ones this process was given."""

    def __init__(self, count, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
        self.seen = set()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        self.seen.add(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="ccl", help="process group backend (gloo gives a reference run)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--by-name", action="store_true",
                        help="pass the backend as ddp_backend and let the library create the group "
                             "(Transformers <= 4.57, Accelerate <= 1.12)")
    args = parser.parse_args()

    if not args.by_name:
        dist.init_process_group(args.backend)

    set_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: runs on two backends must match
    )
    model = GPT2LMHeadModel(config)
    data = RandomTokens(64, seed=1)
    start = sum(p.double().sum().item() for p in model.parameters())

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            logging_steps=1,  # logging gathers the loss across ranks: one more collective per step
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            ddp_find_unused_parameters=False,  # every parameter gets a gradient
            seed=0,
            ddp_backend=args.backend if args.by_name else None,  # None: reuse the group created above
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=data)
        result = trainer.train()

    rank = dist.get_rank()
    params = [p.detach() for p in trainer.model.parameters()]
    checksum = sum(p.double().sum().item() for p in params)
    digest = hashlib.sha256(b"".join(p.contiguous().numpy().tobytes() for p in params)).hexdigest()[:16]
    ddp = isinstance(trainer.model_wrapped, DistributedDataParallel)
    print(f"rank {rank} backend {dist.get_backend()} world {dist.get_world_size()} ddp {ddp}", flush=True)
    print(f"rank {rank} transformers {transformers.__version__} accelerate {accelerate.__version__}", flush=True)
    print(f"rank {rank} samples {sorted(data.seen)}", flush=True)
    print(f"rank {rank} train loss {result.training_loss:.6f}", flush=True)
    print(f"rank {rank} initial checksum {start:.10f}", flush=True)
    print(f"rank {rank} parameter digest {digest}", flush=True)
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
    # Free the DDP wrapper while the group is still registered. If its reducer dropped the
    # last reference, gloo's group destructor would run holding the GIL and could deadlock
    # with a worker thread that needs the GIL (pytorch/pytorch#56297).
    del trainer, params
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
