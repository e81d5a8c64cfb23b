"""Which gloo operations on CUDA tensors work on this machine (2 ranks sharing GPU 0).

    python3 benchmarks/gloo_cuda_probe.py

Each case runs in two fresh processes (a crash in one case leaves the others' answers); the
result of the one run so far is in benchmarks/gpu.md. Needs one CUDA GPU.
"""
import faulthandler, subprocess, sys

CASES = ["all_reduce", "all_gather_into_tensor", "all_gather_list", "funcol_all_reduce", "funcol_all_gather",
         "reduce_scatter", "broadcast", "barrier_then_cpu", "cuda_mesh_from_group", "dtensor_full_tensor"]

def worker(rank, case, port):
    faulthandler.enable()
    import torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.full((4, 3), float(rank + 1), device="cuda")
    if case == "all_reduce":
        dist.all_reduce(x); out = x
    elif case == "all_gather_into_tensor":
        out = torch.empty(8, 3, device="cuda"); dist.all_gather_into_tensor(out, x)
    elif case == "all_gather_list":
        outs = [torch.empty_like(x) for _ in range(2)]; dist.all_gather(outs, x); out = torch.cat(outs)
    elif case == "funcol_all_reduce":
        import torch.distributed._functional_collectives as f
        out = f.wait_tensor(f.all_reduce(x, "sum", dist.group.WORLD))
    elif case == "funcol_all_gather":
        import torch.distributed._functional_collectives as f
        out = f.wait_tensor(f.all_gather_tensor(x, 0, dist.group.WORLD))
    elif case == "reduce_scatter":
        out = torch.empty(2, 3, device="cuda"); dist.reduce_scatter_tensor(out, x)
    elif case == "broadcast":
        dist.broadcast(x, 0); out = x
    elif case == "barrier_then_cpu":
        dist.barrier(); y = x.cpu(); dist.all_reduce(y); out = y
    elif case == "cuda_mesh_from_group":
        from torch.distributed.device_mesh import DeviceMesh
        m = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        out = torch.tensor([m.size()])
    elif case == "dtensor_full_tensor":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        m = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        out = DTensor.from_local(x, m, [Shard(0)], run_check=False).full_tensor()
    torch.cuda.synchronize()
    print(f"{case} rank {rank} ok {out.flatten()[:4].tolist()}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])); sys.exit(0)
    for i, case in enumerate(CASES):
        port = 29600 + i
        procs = [subprocess.Popen([sys.executable, __file__, str(r), case, str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        for p in procs:
            try:
                out, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill(); out, _ = p.communicate()
            lines = [l for l in out.splitlines() if " ok " in l or "Error" in l or "Fatal" in l or "File \"" in l][:8]
            print(f"== {case}: exit {p.returncode}: " + " | ".join(lines), flush=True)
