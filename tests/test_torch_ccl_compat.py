"""What code written for Intel's torch-ccl relies on, beyond init_process_group("ccl"):
a process group built directly, `ProcessGroupCCL(store, rank, size)`, and the wording of its
errors, which such code (torch-ccl's own test file among it) matches with regexes. Each
result is compared with gloo's on the same inputs, through gloo's own class.
"""

import torch
import torch.distributed as dist

from harness import run_ranks


def _direct(rank, world):
    """Collectives on groups made by hand, ccl's and gloo's, from one store."""
    import oneccl_bind_pt

    store = dist.PrefixStore("direct", dist.distributed_c10d._get_default_store())
    pgs = {"ccl": oneccl_bind_pt.ProcessGroupCCL(dist.PrefixStore("ccl", store), rank, world),
           "gloo": dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world)}
    out = {}
    for name, pg in pgs.items():
        x = torch.arange(4, dtype=torch.float32) + rank
        pg.allreduce([x]).wait()
        b = torch.full((3,), float(rank))
        opts = dist.BroadcastOptions()
        opts.rootRank = world - 1
        pg.broadcast([b], opts).wait()
        gathered = torch.empty(world * 2)
        pg._allgather_base(gathered, torch.full((2,), float(rank))).wait()
        coalesced = [torch.ones(2) * (rank + 1), torch.ones(3) * (rank + 1)]
        pg.allreduce_coalesced(coalesced).wait()
        pg.barrier().wait()
        # Plain lists: tensors would travel through shared memory the exiting rank frees.
        out[name] = [t.tolist() for t in (x, b, gathered, *coalesced)]
    return out


def test_a_process_group_made_directly_computes_what_gloo_computes():
    for rank, res in enumerate(run_ranks(_direct, 2)):
        for ccl, gloo in zip(res["ccl"], res["gloo"]):
            assert ccl == gloo, (rank, ccl, gloo)


def _errors(rank, world):
    """(type name, message) of each mistake, on ccl and on gloo."""
    import oneccl_bind_pt

    store = dist.distributed_c10d._get_default_store()
    pgs = {"ccl": oneccl_bind_pt.ProcessGroupCCL(dist.PrefixStore("ccl", store), rank, world),
           "gloo": dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world)}
    seen = {}
    for name, pg in pgs.items():
        opts = dist.BroadcastOptions()
        opts.rootRank = -1
        cases = {
            "root -1": lambda: pg.broadcast([torch.zeros(1)], opts).wait(),
            "dtype": lambda: pg._allgather_base(torch.empty(world, dtype=torch.long),
                                                torch.zeros(1, dtype=torch.float)).wait(),
        }
        for case, call in cases.items():
            try:
                call()
                seen[(name, case)] = None
            except Exception as e:  # noqa: BLE001 - the test compares what was raised
                seen[(name, case)] = (type(e), str(e))
        pg.barrier().wait()  # both groups still work after the mistakes
    return seen


def test_errors_carry_torch_ccl_wording_and_gloo_types():
    for seen in run_ranks(_errors, 2):
        for case, phrase in (("root -1", "unexpected rank"), ("dtype", "Tensors are not equal in data type")):
            ccl, gloo = seen[("ccl", case)], seen[("gloo", case)]
            assert ccl is not None and gloo is not None, (case, ccl, gloo)
            # torch-ccl's phrase, ours (the op and what was expected), and a type gloo's error is too.
            assert phrase in ccl[1] and "ccl " in ccl[1], ccl
            assert issubclass(ccl[0], gloo[0]), (case, ccl, gloo)


def _direct_first(rank, world):
    """A ccl group built directly as the process's first (the default group is gloo's)."""
    import os

    import oneccl_bind_pt

    store = dist.PrefixStore("direct-first", dist.distributed_c10d._get_default_store())
    pg = oneccl_bind_pt.ProcessGroupCCL(store, rank, world)
    x = torch.arange(4, dtype=torch.float32) + rank
    pg.allreduce([x]).wait()
    path = pg._path("allreduce", 16)
    return {k: os.environ.get(k) for k in ("CCL_LOCAL_RANK", "CCL_LOCAL_SIZE", "CCL_ATL_TRANSPORT")}, \
        x.tolist(), path, oneccl_bind_pt._C.helpers()


# torch-ccl's users built groups directly, with no init_process_group("ccl") before: such a group
# gets the package's oneCCL defaults too (the ranks on this host, libfabric, ...), as its first.
def test_a_group_made_directly_first_gets_the_package_defaults():
    for rank, (env, x, path, helpers) in enumerate(run_ranks(_direct_first, 2, backend="gloo",
                                                             env={"ONECCL_BIND_PT_HELPERS": ""})):
        assert "2 ranks" in helpers, helpers  # the count knows the host's other rank (however it divides)
        assert env == {"CCL_LOCAL_RANK": str(rank), "CCL_LOCAL_SIZE": "2", "CCL_ATL_TRANSPORT": "ofi"}, env
        assert x == [1.0, 3.0, 5.0, 7.0], x
        assert path == "shm", path
