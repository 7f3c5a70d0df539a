"""Pure drawing functions ``draw_<thing>(ax, data, **params)`` and the data functions behind them."""
from .routing import draw_assignment_cost, draw_block_layout, draw_padding_waste, draw_topk_heatmap, expert_colors
from .routing_data import assignment_costs, find_crossover, padding_by_block_size, padding_stats

__all__ = [
    "assignment_costs",
    "draw_assignment_cost",
    "draw_block_layout",
    "draw_padding_waste",
    "draw_topk_heatmap",
    "expert_colors",
    "find_crossover",
    "padding_by_block_size",
    "padding_stats",
]
