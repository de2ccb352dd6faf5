"""Mixture-of-experts pieces: routers, this rank's stacked experts, sparse blocks
with and without shared experts, and the CausalLM that maps per-expert
checkpoint names onto the stacked tensors.

Routers reproduce the Hugging Face (transformers 5) formulas op for op; each
returns (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64).
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.models.cpu_gemm import PackedLinear
from engine.models.expert_parallel import ExpertParallel
from engine.models.layers import Linear, SiluMLP, StepContext
from engine.models.llama import CausalLM

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class KeepsFloat32(nn.Module):
    """Follows `.to(device)` but ignores dtype casts, like HF's `_keep_in_fp32_modules`."""

    def _apply(self, fn, recurse=True):
        # Hide own tensors from the default conversion, then move them without a cast.
        kept = [(store, name, t) for store in (self._parameters, self._buffers)
                for name, t in store.items() if t is not None]
        for store, name, _ in kept:
            store[name] = None
        super()._apply(fn, recurse)
        for store, name, t in kept:
            device = fn(torch.empty(0, device=t.device)).device
            if isinstance(t, nn.Parameter):
                t.data = t.data.to(device)
            else:
                t = t.to(device)
            store[name] = t
        return self


class SoftmaxTopKRouter(nn.Module):
    """Mixtral / Qwen2-MoE / Qwen3-MoE: softmax over all experts, top-k, optional renormalisation.

    Qwen rounds the weights back to the model dtype, Mixtral keeps them in float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 round_to_model_dtype: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.round_to_model_dtype = round_to_model_dtype

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)                      # [T, E], model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_to_model_dtype:
            weights = weights.to(logits.dtype).float()
        return weights, ids


class DeepseekV2Router(KeepsFloat32):
    """Softmax scores; `greedy` or `group_limited_greedy` (best expert per group picks groups).

    Like transformers, V2 ignores `norm_topk_prob`; weights are scaled by routed_scaling_factor.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, topk_method: str,
                 num_groups: int | None, topk_group: int | None, routed_scaling_factor: float):
        super().__init__()
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: DeepSeek-V2 supports greedy and group_limited_greedy, "
                             f"got {topk_method!r}")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.topk_method = top_k, topk_method
        self.num_groups, self.topk_group = num_groups, topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)         # [T, E]
        if self.topk_method == "group_limited_greedy":
            num_experts = scores.shape[-1]
            group_scores = scores.view(-1, self.num_groups, num_experts // self.num_groups).max(dim=-1).values
            keep = _group_mask(group_scores, self.topk_group, num_experts)
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids


class DeepseekV3Router(KeepsFloat32):
    """noaux_tc: sigmoid scores; choice uses score + e_score_correction_bias, groups ranked by
    the sum of their top-2, top-k within the best `topk_group` groups; weights from raw scores."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_groups: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.top_k, self.num_groups, self.topk_group = top_k, num_groups, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()  # [T, E]
        num_experts = scores.shape[-1]
        for_choice = scores + self.e_score_correction_bias
        group_scores = (for_choice.view(-1, self.num_groups, num_experts // self.num_groups)
                        .topk(2, dim=-1)[0].sum(dim=-1))
        keep = _group_mask(group_scores, self.topk_group, num_experts)
        for_choice = for_choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, E] bool: experts inside each token's `topk_group` best groups."""
    num_groups = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return (group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups)
            .reshape(-1, num_experts).bool())


class StackedExperts(nn.Module):
    """This rank's routed experts as two stacked tensors, HF's fused layout:
    gate_up_proj [num_local, 2 * intermediate, hidden] (gate rows first), down_proj [num_local, hidden, intermediate].
    Hub checkpoints store them per expert (`checkpoint_targets` says where each one goes);
    transformers 5 can also save its in-memory layout, one all-experts tensor per projection
    named like the stacked parameter (`fused_checkpoint_names`, `load_fused`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, owned: range,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.owned, self.names = owned, names
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(len(owned), 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(owned), hidden_size, intermediate_size))
        self.packed: list[tuple[PackedLinear, PackedLinear]] | None = None  # CPU, see pack()

    def pack(self) -> None:
        """CPU: one oneDNN-prepacked gate|up and down per local expert (see cpu_gemm); the
        stacked parameters are released."""
        self.packed = [(PackedLinear(self.gate_up_proj[i]), PackedLinear(self.down_proj[i]))
                       for i in range(len(self.owned))]
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.new_empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.new_empty(0), requires_grad=False)

    def checkpoint_targets(self, prefix: str) -> dict[str, Callable[[], torch.Tensor]]:
        """Checkpoint name -> (lazy) view of the parameter slice it fills; local experts only."""
        gate, up, down = self.names
        inter = self.intermediate_size
        targets = {}
        for local, expert in enumerate(self.owned):
            base = f"{prefix}.{expert}."
            targets[base + gate + ".weight"] = lambda i=local: self.gate_up_proj[i, :inter]
            targets[base + up + ".weight"] = lambda i=local: self.gate_up_proj[i, inter:]
            targets[base + down + ".weight"] = lambda i=local: self.down_proj[i]
        return targets

    def fused_checkpoint_names(self, prefix: str) -> dict[str, tuple[str, ...]]:
        """Fused checkpoint name -> the per-expert names it stands for (local experts only)."""
        gate, up, down = self.names
        local = [f"{prefix}.{expert}." for expert in self.owned]
        return {f"{prefix}.gate_up_proj": tuple(base + name + ".weight" for base in local for name in (gate, up)),
                f"{prefix}.down_proj": tuple(base + down + ".weight" for base in local)}

    def load_fused(self, projection: str, tensor: torch.Tensor) -> None:
        """Fill `gate_up_proj` or `down_proj` from a [num_experts, ...] tensor: this rank's experts."""
        param = getattr(self, projection)
        mine = tensor[self.owned.start:self.owned.stop]
        if mine.shape != param.shape:
            raise ValueError(f"fused experts tensor {projection!r} of shape {tuple(tensor.shape)} does not "
                             f"hold experts {self.owned.start}..{self.owned.stop - 1} of shape {tuple(param.shape[1:])}")
        with torch.no_grad():
            param.copy_(mine)

    def forward(self, hidden: torch.Tensor,       # [N, hidden]
                topk_ids: torch.Tensor,           # [N, top_k] global expert ids
                topk_weights: torch.Tensor,       # [N, top_k] float32
                ) -> torch.Tensor:                # [N, hidden], sum over this rank's experts only
        out = torch.zeros_like(hidden)
        top_k = topk_ids.shape[1]
        local_ids = topk_ids.reshape(-1) - self.owned.start
        mine = (local_ids >= 0) & (local_ids < len(self.owned))
        flat = mine.nonzero().squeeze(1)           # positions in [N * top_k] routed here
        if flat.numel() == 0:
            return out
        experts_of_flat = local_ids[flat]
        order = torch.argsort(experts_of_flat, stable=True)  # keeps token order inside an expert
        flat, experts_of_flat = flat[order], experts_of_flat[order]
        counts = torch.bincount(experts_of_flat, minlength=len(self.owned)).tolist()
        weights = topk_weights.reshape(-1)
        start = 0
        # Ascending expert order, index_add per expert: the same summation order as HF's eager loop.
        for local, count in enumerate(counts):
            if count == 0:
                continue
            picked = flat[start:start + count]
            start += count
            token_idx = picked // top_k
            expert_out = self._expert(local, hidden[token_idx])
            expert_out = expert_out * weights[picked, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out

    def forward_fixed(self, hidden: torch.Tensor,  # [N, hidden]
                      topk_ids: torch.Tensor,      # [N, top_k] global expert ids
                      topk_weights: torch.Tensor,  # [N, top_k] float32
                      ) -> torch.Tensor:           # [N, hidden], sum over this rank's experts only
        """`forward` without reading anything back to the host, for fixed-shape (CUDA-graph)
        steps: every local expert runs over all N rows, and a row keeps expert e's output, times
        its routing weight, only where it routed to e (torch.where: rows that did not route there
        take an exact 0, even if the expert's output on them is not finite). Rows stay
        independent, so a padded row changes no other row. Accumulated in ascending expert order
        from zeros like `forward`, so only the GEMMs' row count differs (rounding, ~1e-6).
        Costs every local expert over every row: dense, fine for decode sizes, not for prefill."""
        out = torch.zeros_like(hidden)
        for local, expert in enumerate(self.owned):
            routed = topk_ids == expert                                                  # [N, top_k]
            weight = torch.where(routed, topk_weights, 0.0).sum(dim=1, keepdim=True)    # [N, 1], one term
            expert_out = (self._expert(local, hidden) * weight).to(out.dtype)
            out = out + torch.where(routed.any(dim=1, keepdim=True), expert_out, 0.0)
        return out

    def _expert(self, local: int, rows: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        if self.packed is not None:
            gate_up, down = self.packed[local]
            gate, up = gate_up(rows).chunk(2, dim=-1)
            return down(F.silu(gate) * up)
        gate, up = F.linear(rows, self.gate_up_proj[local]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[local])


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + routed `experts`; the experts run wherever expert parallelism puts them."""

    def __init__(self, gate: nn.Module, experts: StackedExperts, ep: ExpertParallel):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep = ep

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        topk_weights, topk_ids = self.gate(hidden)  # routed once, by the rank owning the tokens
        # A fixed-shape (CUDA-graph) step: no host read-back anywhere (StackedExperts.forward_fixed).
        experts = self.experts.forward_fixed if self.ep.fixed_shape else self.experts
        return self.ep.run_experts(experts, hidden, topk_ids, topk_weights)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.routed(hidden)


class SharedExpertsMoeBlock(SparseMoeBlock):
    """DeepSeek: routed experts + an always-on `shared_experts` MLP."""

    def __init__(self, gate: nn.Module, experts: StackedExperts, ep: ExpertParallel,
                 shared_experts: nn.Module | None):
        super().__init__(gate, experts, ep)
        self.shared_experts = shared_experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.routed(hidden)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


class GatedSharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE: routed experts + `shared_expert` scaled by sigmoid(`shared_expert_gate`)."""

    def __init__(self, gate: nn.Module, experts: StackedExperts, ep: ExpertParallel,
                 hidden_size: int, shared_intermediate_size: int):
        super().__init__(gate, experts, ep)
        self.shared_expert = SiluMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(hidden)
        routed = self.routed(hidden)
        return routed + torch.sigmoid(self.shared_expert_gate(hidden)) * shared


class MoECausalLM(CausalLM):
    """CausalLM whose experts are stacked and sharded: checkpoint names stay per expert,
    and a rank neither wants nor expects the experts other ranks own. Checkpoints in
    transformers 5's own layout (fused experts, renamed modules) load too: `aliases` maps
    its module names to this model's, as transformers' conversion mapping does in reverse."""

    def __init__(self, config: EngineConfig, make_layer: Callable[[EngineConfig, int, ExpertParallel], nn.Module],
                 aliases: dict[str, str] | None = None):
        ep = ExpertParallel.from_config(config)
        super().__init__(config, lambda cfg, i: make_layer(cfg, i, ep))
        self.ep = ep
        self._aliases = dict(aliases or {})
        self._expert_targets: dict[str, Callable[[], torch.Tensor]] = {}
        # fused checkpoint name (= the stacked parameter's name) -> (its module, the per-expert names it covers)
        self._fused: dict[str, tuple[StackedExperts, tuple[str, ...]]] = {}
        for name, module in self.named_modules():
            if isinstance(module, StackedExperts):
                self._expert_targets.update(module.checkpoint_targets(name))
                for fused, covered in module.fused_checkpoint_names(name).items():
                    self._fused[fused] = (module, covered)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        with self.ep.step(input_ids.shape[0], fixed_shape=ctx.meta.fixed_shape):
            return self.model(input_ids, positions, ctx)  # [num_tokens, hidden]

    def _model_name(self, name: str) -> str:
        for alias, own in self._aliases.items():
            name = name.replace(alias, own)
        return name

    def wants_weight(self, name: str) -> bool:
        name = self._model_name(name)
        layer = _LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= self.config.model.num_layers:
            return False  # e.g. DeepSeek-V3's multi-token-prediction layer
        if name.endswith("rotary_emb.inv_freq"):
            return False  # derived, stored by some old checkpoints
        if name in self._fused:
            return True  # every rank reads all experts and keeps its own
        if _EXPERT_NAME.search(name):
            return name in self._expert_targets
        return super().wants_weight(name)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = self._model_name(name)
        if name in self._fused:
            if tensor.shape[0] != self.config.model.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} holds {tensor.shape[0]} experts, "
                                 f"the config says {self.config.model.num_experts}")
            self._fused[name][0].load_fused(name.rsplit(".", 1)[1], tensor)
            return
        target = self._expert_targets.get(name)
        if target is None:
            if _EXPERT_NAME.search(name):
                raise ValueError(f"checkpoint tensor {name!r}: expert not owned by rank {self.ep.rank}")
            super().load_weight(name, tensor)
            return
        view = target()
        if view.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
        with torch.no_grad():
            view.copy_(tensor)

    def expected_weights(self) -> set[str]:
        dense = {n for n in self.state_dict() if n not in self._fused and self.wants_weight(n)}
        return dense | set(self._expert_targets)

    def missing_weights(self, loaded: set[str]) -> set[str]:
        covered: set[str] = set()
        for name in map(self._model_name, loaded):
            covered.update(self._fused[name][1] if name in self._fused else (name,))
        return self.expected_weights() - covered
