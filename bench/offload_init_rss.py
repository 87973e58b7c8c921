"""Reproduces issue 21 item 1: RSS growth of building (init_context), `zerodp.initialize` and the first
steps of a 48 x Linear(2048, 2048) MLP (201M parameters, fp32 AdamW) at stage 3 on 2 gloo ranks.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/offload_init_rss.py both
    (modes: none | both | param | opt; env: D=layers W=width STEPS=n STAGE=0-3; MIC=max_in_cpu and SG=sub_group_size,
     both "unset" by default: a user's config, only device and nvme_path;
     each line ends with abs_peak_mib=, the absolute peak RSS in MiB, for bench/estimate_rss.py;
     TRIMCHECK=1 also reports RSS after one malloc_trim right after initialize, as a diagnosis only)

Memory is what the OS sees: VmHWM (peak RSS, reset with /proc/self/clear_refs 5 after a warm-up) and
VmRSS, both minus the RSS before the model is built; printed as "peak/current" GiB per phase.
Offload files go to /tmp/offl/nvme. See bench/results/offload_init_rss.md.
"""
import os, sys, time, tempfile, json
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
import zerodp

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"): return int(line.split()[1]) * 1024
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"): return int(line.split()[1]) * 1024
def reset_hwm():
    with open("/proc/self/clear_refs", "w") as f: f.write("5")

MODE = sys.argv[1]  # none | both | param | opt
WIDTH, DEPTH = int(os.environ.get("W", 2048)), int(os.environ.get("D", 48))
STEPS = int(os.environ.get("STEPS", 3))
nvme = os.environ.get("NVME", "/tmp/offl/nvme"); os.makedirs(nvme, exist_ok=True)
zero = {"stage": int(os.environ.get("STAGE", 3))}  # STAGE=0-2 (mode none) for the estimate's stage checks
if os.environ.get("SG", "unset") != "unset": zero["sub_group_size"] = int(float(os.environ["SG"]))
if MODE in ("both", "param"):
    zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    if os.environ.get("MIC", "unset") != "unset": zero["offload_param"]["max_in_cpu"] = int(float(os.environ["MIC"]))
if MODE in ("both", "opt"):
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}
import contextlib
build = (lambda: zerodp.init_context(cfg)) if zero["stage"] == 3 else contextlib.nullcontext  # only stage 3 partitions
# warm-up
with build():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
e = zerodp.initialize(m, torch.optim.AdamW(m.parameters()), cfg)
e.backward(F.mse_loss(e(torch.ones(4, 64)), torch.zeros(4, 64))); e.step(); e.close(); del e, m
import gc; gc.collect()
start = rss(); reset_hwm()
out = {}
t0 = time.time()
with build():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
out["built"] = (hwm() - start, rss() - start)
engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
out["initialized"] = (hwm() - start, rss() - start)
if os.environ.get("TRIMCHECK"):
    import ctypes; ctypes.CDLL("libc.so.6").malloc_trim(0); out["init_trimmed"] = (hwm() - start, rss() - start)
g = torch.Generator().manual_seed(dist.get_rank())
losses = []
for s in range(STEPS):
    x = torch.randn(4, WIDTH, generator=g)
    loss = F.mse_loss(engine(x), x)
    engine.backward(loss); engine.step(); losses.append(loss.item())
    out[f"step{s}"] = (hwm() - start, rss() - start)
out["time_s"] = time.time() - t0
# absolute VmHWM since the reset (the warm-up's peak is below it), after the losses: the phases' JSON stays as it was
absolute = f"abs_peak_mib={hwm() / 2**20:.1f} start_mib={start / 2**20:.1f}"
numel = sum(p.numel() for p in model.parameters())
if dist.get_rank() == 0 or True:
    # one write of one line: the two ranks share the pipe, and a single write() below 4 KiB is not interleaved
    line = " ".join([MODE, str(dist.get_rank()), f"numel={numel/1e6:.1f}M", json.dumps({k: (f"{v[0]/2**30:.2f}/{v[1]/2**30:.2f}" if isinstance(v, tuple) else round(v,1)) for k, v in out.items()}), str(losses), absolute])
    os.write(1, (line + "\n").encode())
engine.close()
import os; os._exit(0)  # engine.close() destroyed the process group zerodp created
