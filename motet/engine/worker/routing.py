"""A mixture-of-experts router: the linear map to one logit per expert, and how its logits choose each token's
experts and their weights (ModelConfig's router options): a softmax over all experts and its top-k (Mixtral,
Qwen-MoE, GPT-OSS), or DeepSeek's: each expert's sigmoid with a correction bias for choosing (V3), the choice
limited to the best groups of experts (V2's group_limited_greedy, V3's), the weights scaled by
`routed_scaling_factor`."""

from __future__ import annotations

import torch
from torch import nn

from motet.engine.worker.layers import Linear
from motet.models.config import ModelConfig


class Router(Linear):
    """The router's projection (`gate` in every checkpoint), V3's `e_score_correction_bias` beside it, and the
    choice of experts (`route`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.num_experts, bias=cfg.expert_bias)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.sigmoid = cfg.router_scoring == "sigmoid"
        self.groups, self.groups_kept = cfg.expert_groups, cfg.expert_groups_kept
        self.scale = cfg.routed_scaling_factor
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False) if cfg.router_score_bias else None
        )

    @property
    def plain(self) -> bool:
        """A softmax over all experts and its top-k, nothing else (the native MoE op's `route`; DeepSeek's others:
        its routing options, motet/kernels/csrc/routing.h)."""
        return not (self.sigmoid or self.groups > 1 or self.e_score_correction_bias is not None) and (
            self.scale == 1.0
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token of `x`, as transformers' routers compute them."""
        logits = self(x).float()
        if self.plain:
            weights, expert_ids = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, expert_ids
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()
        if self.groups > 1:  # only the experts of the best groups may be chosen
            T = choice.shape[0]
            grouped = choice.view(T, self.groups, -1)
            # a group's score: its best expert's, or with the bias (V3) its best two's sum
            group_scores = (
                grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
                if bias is not None
                else grouped.amax(-1)
            )
            kept = group_scores.topk(self.groups_kept, dim=-1, sorted=False).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            # V2 zeroes the others' softmax scores (and weighs by the masked scores), V3 rules them out
            hidden = ~mask.unsqueeze(-1).expand_as(grouped).reshape(T, -1)
            choice = choice.masked_fill(hidden, float("-inf") if bias is not None else 0.0)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = (scores if bias is not None else choice).gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, expert_ids
