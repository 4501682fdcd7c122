"""DSpark drafter: a DFlash backbone plus a Markov head and a confidence head (reference:
deepseek-ai/DeepSpec `deepspec/modeling/dspark/*`, arXiv 2607.05147; SGLang's DSpark loader).

Names follow DeepSpec's checkpoints: the backbone as DFlash (`fc`, `hidden_norm`, `layers.N...`,
`norm`), `markov_head.markov_w1.weight` (Embedding V x r), `markov_head.markov_w2.weight`
(Linear r -> V, no bias), `confidence_head.proj.{weight,bias}` (Linear(H + r, 1) *with* bias, as
DeepSpec's AcceptRatePredictor). `drafter.markov_w1` / `drafter.markov_w2` are shortcuts.

Label convention (the difference to DFlash): the block is [anchor, MASK x (gamma-1)] at positions
p .. p+gamma-1 and block index k predicts the token at p+k+1, so gamma inputs give gamma drafts
(`label_shift = 1`, DeepSpec's convention). The context K/V cover positions < p, exactly as
DFlash (DeepSpec's training mask: context slots < anchor position, the whole block non-causally).

Per-position math, k = 0..gamma-1, h_k = the backbone's post-norm hidden (what the LM head reads):
    U_k = lm_head(h_k)                                        (the target's LM head, shared)
    l_k = U_k + markov_bias(prev)                             vanilla: W2 W1[prev]
    x_k = argmax(l_k)  or  sample softmax(l_k / T)
    z_k = w . [h_k ; W1[prev]] + b                            confidence logit, c_k = sigmoid(z_k)
    prev = x_k                                                (prev starts as the anchor token)
Markov variants (DeepSpec `markov_head_type`; vanilla is the default and the recommended one):
    gated:  g = sigmoid(gate_proj([h_k ; W1[prev]])), bias = W2 (g * W1[prev])
    gru:    (DeepSpec "rnn") state s_0 = 0; [a, c, o] = joint_proj([s ; W1[prev] ; h_k]);
            s' = sigmoid(a) * s + (1 - sigmoid(a)) * tanh(c); bias = W2 tanh(o)

Calibration: `sts_temperatures` [gamma] (ones by default) divide the confidence logits before the
survival product prod_{i<=k} sigmoid(z_i / T_i) (`survival`). The checkpoint code stores them in
config.json, since the official safetensors key set has no such tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specrt.plugins.errors import SpecrtError
from specrt.export.models.config import LlamaConfig
from specrt.export.models.dflash import DFlashConfig, DFlashDrafter

MARKOV_VARIANTS = ("vanilla", "gated", "gru")
_VARIANT_ALIASES = {"rnn": "gru"}  # DeepSpec calls the GRU-like head "rnn"


@dataclass
class DSparkConfig(DFlashConfig):
    block_size: int = 7  # gamma: block inputs = drafts per round
    markov_rank: int = 256
    markov_variant: str = "vanilla"
    confidence_with_markov: bool = True  # DeepSpec confidence_head_with_markov
    convention: str = "deepspec"  # index k predicts p+k+1: gamma inputs give gamma drafts

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.convention != "deepspec":
            raise SpecrtError(f"a DSpark drafter follows DeepSpec's block convention, not {self.convention!r}",
                              "drop the convention field, or set it to 'deepspec'")
        variant = _VARIANT_ALIASES.get(str(self.markov_variant).lower(), str(self.markov_variant).lower())
        if variant not in MARKOV_VARIANTS:
            raise SpecrtError(
                f"unknown DSpark markov variant {self.markov_variant!r}",
                f"use one of {', '.join(MARKOV_VARIANTS)}",
            )
        self.markov_variant = variant
        if self.markov_rank < 1:
            raise SpecrtError(
                f"DSpark markov_rank must be positive, got {self.markov_rank}",
                "the Markov head is part of DSpark: use a rank such as 256",
            )
        if self.block_size < 1:
            raise SpecrtError(f"DSpark block size (gamma) {self.block_size} gives no drafts", "use gamma >= 1")

    @property
    def gamma(self) -> int:
        return self.block_size

    @classmethod
    def for_target(
        cls,
        target_cfg: LlamaConfig,
        num_layers: int = 1,
        block_size: int = 7,
        mask_token_id: int | None = None,
        num_taps: int = 5,
        intermediate_size: int | None = None,
        markov_rank: int = 256,
        markov_variant: str = "vanilla",
        num_kv_heads: int | None = None,
    ) -> "DSparkConfig":
        fields = cls._target_fields(target_cfg, num_layers, block_size, mask_token_id, num_taps, intermediate_size,
                                    num_kv_heads)
        return cls(**fields, markov_rank=markov_rank, markov_variant=markov_variant)


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, variant: str = "vanilla") -> None:
        super().__init__()
        self.variant = variant
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if variant == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif variant == "gru":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(
        self,
        base_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: base_logits [..., V] + bias(prev) -> (logits float32, next state).

        output_rows: W2's rows of a reduced draft vocabulary ([N, r], `markov_w2.weight[ids]`), whose
        base_logits are [..., N]; prev_tokens stay target ids (W1 is indexed by any target token)."""
        e = self.markov_w1(prev_tokens)
        if self.variant == "vanilla":
            x = e
        elif self.variant == "gated":
            if hidden is None:
                raise SpecrtError("the gated Markov head needs the backbone hidden state", "pass hidden")
            x = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1))) * e
        else:
            if hidden is None:
                raise SpecrtError("the GRU Markov head needs the backbone hidden state", "pass hidden")
            if state is None:
                state = torch.zeros_like(e)
            a, c, o = self.joint_proj(torch.cat([state, e, hidden.to(e.dtype)], dim=-1)).chunk(3, dim=-1)
            update = torch.sigmoid(a)
            state = update * state + (1.0 - update) * torch.tanh(c)
            x = torch.tanh(o)
        bias = self.markov_w2(x) if output_rows is None else F.linear(x, output_rows)
        return base_logits.float() + bias.float(), state


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)  # with bias (DeepSpec AcceptRatePredictor)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.markov_variant)
        conf_in = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_in)
        self.register_buffer("sts_temperatures", torch.ones(cfg.block_size))

    @property
    def markov_w1(self) -> nn.Embedding:
        return self.markov_head.markov_w1

    @property
    def markov_w2(self) -> nn.Linear:
        return self.markov_head.markov_w2

    # -- heads ---------------------------------------------------------------------------------
    def markov_logits(
        self,
        base_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """l_k = U_k + W2 W1[prev] (vanilla) for base_logits [B, V], prev_tokens [B] -> [B, V] float32.

        gated/gru also read `hidden` [B, H]; gru carries `state` (use `markov_step` to get it back).
        """
        return self.markov_head.step(base_logits, prev_tokens, hidden, state)[0]

    def markov_step(self, base_logits, prev_tokens, hidden=None, state=None):
        """markov_logits plus the recurrent state (None for vanilla/gated)."""
        return self.markov_head.step(base_logits, prev_tokens, hidden, state)

    def markov_block_logits(
        self, base_logits: torch.Tensor, prev_tokens: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced Markov logits for a whole block (training): [B, K, V], prev [B, K], hidden [B, K, H]."""
        if self.markov_head.variant != "gru":
            return self.markov_head.step(base_logits, prev_tokens, hidden)[0]
        state, rows = None, []
        for k in range(base_logits.shape[1]):
            row, state = self.markov_head.step(base_logits[:, k], prev_tokens[:, k], hidden[:, k], state)
            rows.append(row)
        return torch.stack(rows, dim=1)

    def confidence(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid confidence z = w . [h ; W1[prev]] + b; hidden [..., H], prev [...] -> [...] float32."""
        features = hidden.to(self.markov_w1.weight.dtype)
        if self.config.confidence_with_markov:
            features = torch.cat([features, self.markov_w1(prev_tokens)], dim=-1)
        return self.confidence_head(features).float()

    def survival(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated survival a_k = prod_{i<=k} sigmoid(z_i / T_i); conf_logits [B, K], K <= gamma."""
        temps = self.sts_temperatures[: conf_logits.shape[-1]].float()
        return torch.cumprod(torch.sigmoid(conf_logits.float() / temps), dim=-1)

    # -- one drafting round ----------------------------------------------------------------------
    @torch.no_grad()
    def draft(
        self,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        gumbel: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Backbone once, then the Markov chain over the block.

        Returns tokens [B, gamma] (int64, target ids), draft_probs [B, gamma, V] = softmax(l_k / T)
        (None when temperature == 0: greedy) and conf_logits [B, gamma] (pre-sigmoid z_k).
        gumbel [B, gamma, V]: the caller's noise (seeded rows' coupled drafts), temperature then a
        [B] tensor: x_k = argmax(l_k + T * g_k), as the exported graph takes it; draft_probs None.
        """
        base, hidden = self.forward(block_ids, position_ids, attn_mask, k_cache, v_cache, write_slots)
        prev = block_ids[:, 0]
        state = None
        tokens, probs, confs = [], [], []
        if gumbel is not None:  # per-row scale of the caller's noise
            scale = torch.as_tensor(temperature, dtype=base.dtype, device=base.device).expand(base.shape[0])[:, None]
        for k in range(block_ids.shape[1]):
            logits, state = self.markov_head.step(base[:, k], prev, hidden[:, k], state)
            confs.append(self.confidence(hidden[:, k], prev))
            if gumbel is not None:
                token = torch.argmax(logits + scale * gumbel[:, k].to(logits.dtype), dim=-1)
            elif temperature <= 0:
                token = torch.argmax(logits, dim=-1)
            else:
                p = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(p, 1, generator=generator).squeeze(-1)
                probs.append(p)
            tokens.append(token)
            prev = token
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return torch.stack(tokens, dim=1), draft_probs, torch.stack(confs, dim=1)


__all__ = ["DSparkConfig", "DSparkDrafter", "MarkovHead", "ConfidenceHead", "MARKOV_VARIANTS"]
