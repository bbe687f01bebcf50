"""GPU probe: what torch.profiler reports for a few CUDA ops inside a record_function (ids, correlation ids,
parents), dumped as JSON to $OUT/prof_events.json, to check how moectl/bench/device_time.py links kernels to
the CPU ops and regions that launched them."""
import json, os, torch
from torch.profiler import ProfilerActivity, profile
from torch.autograd.profiler import record_function
x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with record_function("myregion"):
        y = (x @ w).relu().sum()
    y.backward()
    torch.cuda.synchronize()
out = []
for e in prof.events():
    out.append({k: (str(getattr(e, k, None)) if k in ("device_type",) else getattr(e, k, None)) for k in
                ("name", "id", "linked_correlation_id", "device_type", "is_user_annotation", "is_async", "sequence_nr", "thread", "device_resource_id")}
               | {"parent": e.cpu_parent.name if e.cpu_parent is not None else None, "start": e.time_range.start,
                  "kernels": [k.name for k in getattr(e, "kernels", [])][:3]})
json.dump(out, open(os.path.join(os.environ["OUT"], "prof_events.json"), "w"), indent=0, default=str)
print(len(out), "events")
