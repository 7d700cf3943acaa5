"""The `torch.distributed.backends` entry point (setup.py): torch >= 2.14 calls register()
when init_process_group meets the name "ccl" before anything registered it, so scripts that
never import this package still get the backend."""


def register():
    # Importing the package registers "ccl" with torch.distributed (see __init__.py).
    import oneccl_bind_pt  # noqa: F401
