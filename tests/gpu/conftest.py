import pytest


@pytest.fixture(scope="session", autouse=True)
def _gpu_run_line(request):
    """Says once how the GPU tests' ranks run (Note [Ranks sharing a GPU]); tests/conftest.py closes
    their pools with the CPU suites' at the end of the session."""
    from gpu.gpu_ranks import shared, transport, visible_gpus, world

    if visible_gpus():
        how = ("NCCL's socket transport over lo (each rank its own NCCL_HOSTID), not NVLink or P2P"
               if shared() else "one GPU per rank")
        line = (f"ringreduce GPU tests: {world()} ranks on {visible_gpus()} GPU(s), {transport()}: {how} "
                "(RINGREDUCE_GPU_WORLD sets the world size)")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)
