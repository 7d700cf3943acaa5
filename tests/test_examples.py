"""The FSDP2, DTensor and multi-node examples, run as users run them, checked against
the same computation done in this process without any distribution."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from harness import communicate, popen, run_job
from test_launchers import BIN, ROOT, free_port

EXAMPLES = ROOT / "examples"


def _env(**extra):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # No torchrun/MPI context may leak in from the test process.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE"):
        env.pop(var, None)
    return {**env, **extra}


def _run(cmd, cwd, timeout=180, **env):
    return run_job(cmd, cwd, _env(**env), timeout)


def _example(name):
    # Its model and data: the reference below trains the same thing in one process.
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agreed_checksum(out, world):
    # Ranks share stdout, so lines may run together: match the number exactly.
    sums = dict(re.findall(r"rank (\d+) parameter checksum (-?\d+\.\d{10})", out))
    assert sorted(sums) == [str(r) for r in range(world)], out
    assert len(set(sums.values())) == 1, f"ranks disagree: {sums}"
    return float(next(iter(sums.values())))


def _torchrun(script, tmp_path, *args):
    return _run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), script, *args], tmp_path)


def test_fsdp_example_trains_like_one_process_on_the_whole_batch(tmp_path):
    steps = 3
    out = _torchrun(EXAMPLES / "fsdp.py", tmp_path, "--steps", steps, "--save", tmp_path / "full.pt")
    _agreed_checksum(out, 2)
    trained = torch.load(tmp_path / "full.pt")

    ex = _example("fsdp")
    model = ex.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = ex.global_batch(2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sorted(trained) == sorted(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    printed = [float(x) for x in re.findall(r"step \d+: loss (\d+\.\d+)", out)]
    assert printed == pytest.approx(losses, rel=1e-5), out  # the whole batch's loss, averaged over ranks


def test_dtensor_example_matches_full_tensors(tmp_path):
    steps = 3
    out = _torchrun(EXAMPLES / "dtensor.py", tmp_path, "--steps", steps, "--save", tmp_path / "out.pt")
    _agreed_checksum(out, 2)
    got = torch.load(tmp_path / "out.pt")
    assert "local rows of A (4, 6)" in out and "first weight shard (4, 8), second (2, 4)" in out, out

    ex = _example("dtensor")
    a, b = ex.matrices(2)
    torch.testing.assert_close(got.pop("product"), a @ b)
    model = ex.make_mlp(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = ex.batch()
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    assert sorted(got) == sorted(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


# Pipeline parallelism: activations and their gradients cross between the stages' ranks by
# batch_isend_irecv, on shared memory and on oneCCL (the path across hosts).
@pytest.mark.parametrize("schedule, transport", [("1f1b", "shm"), ("1f1b", "oneccl"), ("gpipe", "shm")])
def test_pipeline_example_trains_like_one_process(tmp_path, schedule, transport):
    steps = 3
    out = _run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), EXAMPLES / "pipeline.py",
                "--steps", steps, "--schedule", schedule, "--save", tmp_path / "full.pt"], tmp_path,
               ONECCL_BIND_PT_SHM="0" if transport == "oneccl" else "1")
    _agreed_checksum(out, 2)
    trained = torch.load(tmp_path / "full.pt")

    ex = _example("pipeline")
    model = ex.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = ex.batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        step = []
        for x, y in zip(inputs.chunk(ex.MICROBATCHES), targets.chunk(ex.MICROBATCHES)):
            loss = ex.loss_fn(model(x), y)
            (loss / ex.MICROBATCHES).backward()  # the schedule's scale_grads
            step.append(loss.item())
        optimizer.step()
        losses.append(sum(step) / len(step))
    assert sorted(trained) == sorted(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    printed = [float(x) for x in re.findall(r"step \d+: loss (\d+\.\d+)", out)]
    assert printed == pytest.approx(losses, rel=1e-5), out


# ---- multi-node recipe, two "nodes" on this machine ---------------------------------

TRAIN = EXAMPLES / "multinode" / "train.py"


def _multinode_reference(world):
    # examples/multinode/train.py's DDP run done in one process: averaging the ranks'
    # gradients is the gradient of the mean loss over all ranks' data.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(3):
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for g in gens]
        optimizer.zero_grad()
        sum(nn.functional.mse_loss(model(x), y) for x, y in batches).div(world).backward()
        optimizer.step()
    return sum(p.detach().double().sum().item() for p in model.parameters())


def _check_multinode(out, world=4, per_node=2):
    layout = {int(r): int(lr) for r, lr in re.findall(r"rank (\d+) of 4: host \S+, local rank (\d+)", out)}
    assert layout == {r: r % per_node for r in range(world)}, out
    sums = re.findall(r"rank (\d+) allreduce (\d+\.\d) ", out)
    assert sorted(int(r) for r, _ in sums) == list(range(world)), out
    assert {float(v) for _, v in sums} == {float(sum(r + 1 for r in range(world)))}, out
    assert _agreed_checksum(out, world) == pytest.approx(_multinode_reference(world), rel=1e-6, abs=1e-6)


def test_mpirun_hostfile_two_nodes_of_two(tmp_path):
    # Hydra merges repeated names into one host; two names for this machine make two
    # "nodes" of two ranks each, started locally (no ssh).
    (tmp_path / "hostfile").write_text("localhost\n127.0.0.1\n")
    out = _run([BIN / "mpirun", "-f", "hostfile", "-n", "4", "-ppn", "2", sys.executable, TRAIN], tmp_path,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    _check_multinode(out)


def test_torchrun_two_nodes_of_two(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [
        popen([BIN / "torchrun", "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", node,
               "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "examples", TRAIN],
              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outs = communicate(procs, 180)  # a hang kills both agents' sessions, ranks included
    out = "\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0], out
    _check_multinode(out)
