"""Reference solutions of notebook 04's exercises (``python -m moelora_lab.exercises check`` runs them)."""
from moelora_lab import MoEShape
from moelora_lab.plots.traffic import sweep_workload
from moelora_lab.profile.traffic import layer_traffic


# 04.fork_point: one clock per stream, one completion time per event
def stream_schedule(ops):
    ready, event_at, times = {}, {}, {}
    for op, stream, *args in ops:
        if op == "run":
            stage, duration = args
            start = ready.get(stream, 0.0)
            times[stage] = (start, start + duration)
            ready[stream] = start + duration
        elif op == "record":                       # completes when the stream's earlier work has finished
            event_at[args[0]] = ready.get(stream, 0.0)
        elif op == "wait":                         # later work waits for the event, never starts earlier
            ready[stream] = max(ready.get(stream, 0.0), event_at[args[0]])
    return times


# 04.window: one bus for both kernels: (base + LoRA bytes) at the copy rate measured with the data (4.25 TB/s)
_qwen = MoEShape.from_name("qwen3-30b-a3b")
_stages = layer_traffic(_qwen, 64, sweep_workload(_qwen, 128), lora_path="one_shot")
window_guess = (_stages["base_w13"].bytes + _stages["lora_w13"].bytes) / 4.25e12 * 1e6

# 04.hidden: section 5's table at M = 2048, rank 16: (base + LoRA alone - window) of both pairs over the LoRA alone
hidden_guess = ((281.9 + 54.5 - 323.4) + (167.3 + 41.0 - 199.9)) / (54.5 + 41.0)
