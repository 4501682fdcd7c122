"""DFlash drafter: block diffusion drafting in one forward pass (reference: z-lab/dflash
`model/dflash.py` / `dflash/model.py`, arXiv 2602.06036).

Module names follow z-lab's checkpoints (HF Qwen3 style): `fc`, `hidden_norm`,
`layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`. The target's embedding and LM head
are shared and frozen (`bind_target`); they are non-persistent buffers, never saved with the drafter.

Taps: z-lab's `target_layer_ids` are *layer* indices (the output of layer i, i.e. HF
hidden_states[i + 1]; DeepSpec also allows -1 = the embeddings). Our target taps by hidden_states
index, so `DFlashConfig.tap_layers` holds hidden_states indices = target_layer_ids + 1 and the
checkpoint code converts at the file boundary. Default spread (z-lab `build_target_layer_ids`):
layer ids round(1 + i*(L-4)/(m-1)), i < m (m = 1: L // 2); z-lab takes m = number of draft layers,
here m defaults to 5 (DESIGN.md) and is a parameter of `for_target`.

Two calls per round, both on the drafter's own fixed-capacity cache [Ld, B, Hkv, C, D]:

    drafter.ingest_context(taps, position_ids, k_cache, v_cache, write_slots)
        taps [B, T, m*H] of the newly committed tokens (prompt, or anchor + accepted drafts),
        position_ids [B, T] their absolute positions. Per layer writes K = RoPE(k_norm(W_K H_ctx)),
        V = W_V H_ctx with H_ctx = hidden_norm(fc(taps)) (no input_layernorm, as the reference):
        the context enters attention only as K/V, identically in every layer.

    logits, hidden = drafter(block_ids, position_ids, attn_mask, k_cache, v_cache, write_slots)
        block_ids [B, Bk] = [anchor, MASK x (Bk-1)], position_ids = p .. p+Bk-1 (p = anchor position).
        Each layer writes the block's own K/V at write_slots (scratch: the runtime never commits them;
        the next ingest may overwrite those slots) and attends over the first S cache slots under
        attn_mask [B, Bk, S]: the context slots of positions < p, plus every block slot (non-causal
        inside the block; the caller builds the mask). logits [B, Bk, V] float32 through the target's
        LM head after `norm`; hidden [B, Bk, H] is that post-norm hidden state.

Label convention (`DFlashConfig.convention`): z-lab's DFlash trains block index k on the token at
position p + k (index 0 is the anchor itself), so a block of Bk tokens gives Bk - 1 drafts:
logits[:, 1:] (`label_shift = 0`). DeepSpec's DFlash-mode drafters (its DSpark model with Markov
rank 0 and no confidence head) train index k on p + k + 1: Bk drafts, logits[:, 0:]
(`label_shift = 1`). The weights cannot tell the two apart; the checkpoint format does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig, fill_attention_dims
from specrt.export.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, write_kv


# convention -> label shift. z-lab trains index k on the token at p+k (index 0 is the anchor itself,
# B-1 drafts); DeepSpec (its DSpark model, also its DFlash-mode drafters) on p+k+1 (B drafts).
CONVENTIONS = {"z-lab": 0, "deepspec": 1}


def dflash_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's default taps as *layer* indices (output of layer i = hidden_states[i + 1])."""
    if num_taps < 1:
        raise SpecrtError(f"DFlash needs at least one tap layer, got {num_taps}", "use num_taps >= 1")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


def default_dflash_taps(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """The same taps as target hidden_states indices (what `LlamaModel.set_taps` takes)."""
    return [i + 1 for i in dflash_target_layer_ids(num_target_layers, num_taps)]


@dataclass
class DFlashConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tap_layers: list[int] = field(default_factory=list)  # target hidden_states indices
    block_size: int = 16
    mask_token_id: int = 0
    target_hidden_size: int = 0  # 0 -> hidden_size
    num_target_layers: int = 0  # recorded in config.json (z-lab: num_target_layers)
    max_position_embeddings: int = 4096
    # whose block convention: "z-lab" (index k predicts p+k; a tap on the last layer is read after the
    # final norm) or "deepspec" (index k predicts p+k+1; taps are raw layer outputs). See CONVENTIONS.
    convention: str = "z-lab"
    # the checkpoint format it was loaded from (provenance for the manifest; not part of the math)
    checkpoint_format: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        fill_attention_dims(self, type(self).__name__, "check the drafter's config.json")
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        self.tap_layers = [int(i) for i in self.tap_layers]
        if self.convention not in CONVENTIONS:
            raise SpecrtError(f"unknown block-drafter convention {self.convention!r}",
                              f"use one of {', '.join(CONVENTIONS)}")
        if self.block_size - 1 + self.label_shift < 1:
            raise SpecrtError(
                f"{type(self).__name__} block_size {self.block_size} gives no drafts", "use a larger block size"
            )

    @property
    def label_shift(self) -> int:
        """Block index k predicts the token at position p + k + label_shift (p = the anchor's)."""
        return CONVENTIONS[self.convention]

    @property
    def target_layer_ids(self) -> list[int]:
        """The taps as z-lab writes them: layer indices (hidden_states index - 1)."""
        return [i - 1 for i in self.tap_layers]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def _target_fields(
        cls,
        target_cfg: LlamaConfig,
        num_layers: int,
        block_size: int,
        mask_token_id: int | None,
        num_taps: int,
        intermediate_size: int | None,
        num_kv_heads: int | None = None,
    ) -> dict[str, Any]:
        return dict(
            num_layers=int(num_layers),
            hidden_size=target_cfg.hidden_size,
            num_heads=target_cfg.num_heads,
            num_kv_heads=int(num_kv_heads or target_cfg.num_kv_heads),
            head_dim=target_cfg.head_dim,
            intermediate_size=intermediate_size or target_cfg.intermediate_size,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            rope_scaling=target_cfg.rope_scaling,
            vocab_size=target_cfg.vocab_size,
            tap_layers=default_dflash_taps(target_cfg.num_layers, num_taps),
            block_size=int(block_size),
            # the MASK embedding is the target's (frozen) row of this id: pick a token that never
            # occurs in text; without one the last vocabulary row is used
            mask_token_id=int(target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id),
            target_hidden_size=target_cfg.hidden_size,
            num_target_layers=target_cfg.num_layers,
            max_position_embeddings=target_cfg.max_position_embeddings,
        )

    @classmethod
    def for_target(
        cls,
        target_cfg: LlamaConfig,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        num_taps: int = 5,
        intermediate_size: int | None = None,
        num_kv_heads: int | None = None,
    ) -> "DFlashConfig":
        """Drafter layers with the target's dims (so they can start from the target's last layers).

        `num_kv_heads` (default: the target's) may be any multiple of the target's KV heads that
        divides the query heads: see `repeat_kv_heads` for why a block drafter wants more."""
        return cls(**cls._target_fields(target_cfg, num_layers, block_size, mask_token_id, num_taps, intermediate_size,
                                        num_kv_heads))


class DFlashLayer(nn.Module):
    """Qwen3-style layer (qk-norm, no bias) whose keys/values also hold the projected context."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=True, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def ingest(self, context, cos, sin, k_cache, v_cache, write_slots) -> None:
        k, v = self.self_attn.project_kv(context, cos, sin)
        write_kv(k_cache, write_slots, k)
        write_kv(v_cache, write_slots, v)

    def forward(self, x, cos, sin, k_cache, v_cache, write_slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, write_slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.tap_layers) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # shared with the target, frozen, not saved with the drafter
        self.register_buffer("target_embed_weight", None, persistent=False)
        self.register_buffer("target_lm_head_weight", None, persistent=False)

    @property
    def label_shift(self) -> int:
        """Block index k predicts position p + k + label_shift (0: z-lab, 1: DeepSpec, DSpark)."""
        return self.config.label_shift

    @property
    def num_drafts(self) -> int:
        """Drafts one block yields: block_size - 1 for DFlash (block_size for DSpark)."""
        return self.config.block_size - 1 + self.label_shift

    # -- sharing with the target -------------------------------------------------------------
    def bind_target(self, embed_tokens: nn.Embedding | torch.Tensor, lm_head: nn.Linear | torch.Tensor) -> None:
        """Use the target's input embedding and LM head (frozen). Bind after the target's .to()."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for what, module in (("embedding", embed_tokens), ("LM head", lm_head)):
            weight = module.weight if isinstance(module, nn.Module) else module
            if tuple(weight.shape) != want:
                raise SpecrtError(
                    f"the target {what} is {tuple(weight.shape)}, this {type(self).__name__} needs {want} "
                    "(vocab_size, hidden_size)",
                    "use the drafter trained for this target",
                )
        embed_w = embed_tokens.weight if isinstance(embed_tokens, nn.Module) else embed_tokens
        head_w = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
        self.target_embed_weight = embed_w.detach()
        self.target_lm_head_weight = head_w.detach()

    def _require_bound(self) -> None:
        if self.target_embed_weight is None or self.target_lm_head_weight is None:
            raise SpecrtError(
                f"this {type(self).__name__} shares the target's embedding and LM head, and none were bound",
                "call drafter.bind_target(target.embed_tokens, target.lm_head) before running it",
            )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        self._require_bound()
        return F.embedding(ids, self.target_embed_weight).to(self.fc.weight.dtype)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head over (already normed) hidden states, float32."""
        self._require_bound()
        return F.linear(hidden.to(self.target_lm_head_weight.dtype), self.target_lm_head_weight).float()

    # -- graph pieces ----------------------------------------------------------------------------
    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, m*Ht] -> H_ctx = hidden_norm(fc(taps)) [B, T, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def ingest_context(
        self,
        taps: torch.Tensor,
        position_ids: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
    ) -> None:
        """Write every layer's context K/V (k_norm + RoPE at position_ids) at write_slots, in place."""
        context = self.context_features(taps)
        cos, sin = self.rotary(position_ids)
        for i, layer in enumerate(self.layers):
            layer.ingest(context, cos, sin, k_cache[i], v_cache[i], write_slots)

    def backbone(
        self,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
    ) -> torch.Tensor:
        """Block tokens through the layers; returns the post-norm hidden [B, Bk, H]."""
        x = self.embed(block_ids)
        cos, sin = self.rotary(position_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_cache[i], v_cache[i], write_slots, attn_mask)
        return self.norm(x)

    def forward(
        self,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.backbone(block_ids, position_ids, attn_mask, k_cache, v_cache, write_slots)
        return self.lm_logits(hidden), hidden

    def block_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK x (block_size-1)] for anchor [B] -> [B, block_size]."""
        block = torch.full(
            (anchor.shape[0], self.config.block_size), self.config.mask_token_id, dtype=torch.long, device=anchor.device
        )
        block[:, 0] = anchor
        return block

    def new_cache(
        self, batch: int, capacity: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        device = self.fc.weight.device
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    # -- training helper -------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> list[str]:
        """Start the drafter layers from the target's last `num_layers` layers (and its final norm).

        Copies every tensor whose shape matches; q_norm/k_norm come from a Qwen3 target and start at
        ones otherwise; q/k/v biases of a Qwen2 target are dropped (DFlash layers have none); `fc` and
        `hidden_norm` keep their initialisation. Returns the names of the drafter tensors copied.
        """
        layers = list(target.layers)
        if len(layers) < len(self.layers):
            raise SpecrtError(
                f"the target has {len(layers)} layers, fewer than the drafter's {len(self.layers)}",
                "use fewer drafter layers",
            )
        copied: list[str] = []
        source = layers[len(layers) - len(self.layers):]
        for i, (mine, theirs) in enumerate(zip(self.layers, source)):
            theirs_state = theirs.state_dict()
            for name, tensor in mine.state_dict().items():
                if name.endswith(("q_norm.weight", "k_norm.weight")) and name not in theirs_state:
                    tensor.fill_(1.0)
                    continue
                src = theirs_state.get(name)
                if src is not None and name.endswith(("k_proj.weight", "v_proj.weight")) and src.shape != tensor.shape:
                    src = _repeat_head_rows(src, tensor.shape[0] // self.config.head_dim, self.config.head_dim)
                if src is not None and src.shape == tensor.shape:
                    tensor.copy_(src)
                    copied.append(f"layers.{i}.{name}")
        if hasattr(target, "norm") and target.norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(target.norm.weight)
            copied.append("norm.weight")
        return copied


def _repeat_head_rows(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """k/v projection rows [h * D, in] of h heads -> [heads * D, in], each head repeated heads / h times
    in place (head i of the result is head i // (heads / h) of the input), or unchanged when the
    count does not divide."""
    have = weight.shape[0] // head_dim
    if have == 0 or heads % have or heads == have:
        return weight
    return weight.view(have, head_dim, -1).repeat_interleave(heads // have, dim=0).reshape(heads * head_dim, -1)


@torch.no_grad()
def repeat_kv_heads(drafter: DFlashDrafter, num_kv_heads: int) -> DFlashDrafter:
    """The same drafter with `num_kv_heads` K/V heads (a multiple of its own), computing the same function.

    Why: in a block drafter the target's context reaches the block only as keys/values, and the
    MASK positions' queries carry no content in the first layer, so what a draft can learn about
    the context is bounded by the K/V width: num_kv_heads * head_dim per position (SmolLM2's GQA:
    3 x 64 = 192 of 576 dims). Repeating each head (query head j keeps reading a copy of the head it
    read before) changes nothing at first; training then unties the copies. Cost: the K/V
    projections and the drafter's own cache grow by the factor; the 49k-wide LM head still
    dominates a step.
    """
    cfg = drafter.config
    if num_kv_heads == cfg.num_kv_heads:
        return drafter
    if num_kv_heads % cfg.num_kv_heads or cfg.num_heads % num_kv_heads:
        raise SpecrtError(
            f"cannot grow {cfg.num_kv_heads} K/V heads to {num_kv_heads}: it must be a multiple of "
            f"{cfg.num_kv_heads} that divides the {cfg.num_heads} query heads",
            f"pick one of {[n for n in range(cfg.num_kv_heads, cfg.num_heads + 1) if n % cfg.num_kv_heads == 0 and cfg.num_heads % n == 0]}",
        )
    new_cfg = type(cfg).from_dict({**cfg.to_dict(), "num_kv_heads": int(num_kv_heads)})
    grown = type(drafter)(new_cfg).to(drafter.fc.weight.dtype)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensor = _repeat_head_rows(tensor, num_kv_heads, cfg.head_dim)
        state[name] = tensor
    grown.load_state_dict(state)
    if drafter.target_embed_weight is not None:
        grown.bind_target(drafter.target_embed_weight, drafter.target_lm_head_weight)
    return grown
