"""Reference solutions of notebook 04's exercises (``python -m moelora_lab.exercises check`` runs them)."""
from moelora_lab import MoEShape
from moelora_lab.lesson import data, traces
from moelora_lab.plots.layer import overlap_table
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


# 04.window: one bus for both kernels: (base + LoRA bytes) at the copy rate measured with the committed data
_qwen = MoEShape.from_name("qwen3-30b-a3b")
_stages = layer_traffic(_qwen, 64, sweep_workload(_qwen, 128), lora_path="one_shot")
_copy_bps = data("layer")[0]["copy_tbps"] * 1e12
window_guess = (_stages["base_w13"].bytes + _stages["lora_w13"].bytes) / _copy_bps * 1e6

# 04.hidden: section 5's table at M = 2048, rank 16, from the committed timelines: (one stream - two streams)
# over the LoRA's one-stream busy time
(_row,) = [r for r in overlap_table(traces("layer")) if (r["preset"], r["M"], r["rank"]) == ("qwen3-30b-a3b", 2048, 16)]
hidden_guess = (_row["seq_us"] - _row["dual_us"]) / _row["lora_seq_us"]
