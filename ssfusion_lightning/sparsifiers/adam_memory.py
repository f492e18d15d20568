"""Error feedback on Adam's update: each rank selects from its own Adam step, not from its gradient.

Top-k of an AdamW gradient picks the few coordinates with large raw gradients (a language model's
embedding rows, the output layer) and starves the rest, whose Adam step would have been as large
(Adam normalizes each coordinate by its own history). Selecting the update instead keeps Adam's
per-coordinate scale: on one process, a byte-level LM at density 1% went from a validation loss of
3.08 to 2.79 after 300 steps, dense AdamW 2.38 (experiments/REPORT.md, "Selecting AdamW's update
instead of its gradient").

Per key and round: m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; u = (m / c1) / (sqrt(v / c2) + eps)
with c1, c2 Adam's bias corrections at the key's step; the residual r <- r + u is selected from, and
the sent positions of r are zeroed. The moments are this rank's (from its own gradients); what
crosses the network and is averaged is the update. Applying the averaged update is then plain
gradient descent with the optimizer's learning rate and decoupled weight decay:
``take_over(optimizers)`` returns, for the user's Adam or AdamW, an ``AveragedUpdate`` optimizer
over the same parameter groups (the same dicts, so learning-rate schedules keep acting on them).
The strategy swaps it in.

Error feedback piles each unsent entry's updates up until it is selected, and Adam's update is about
1 in size on every coordinate whatever the gradient's scale, so a selected entry moves by about as
many steps of learning rate as it waited: 8.7 on average at density 1% on the byte-level LM, which
stayed on its byte-frequency plateau past step 100 where dense AdamW had left it. Keeping only a
fraction of the unsent update (``feedback=0.9``: an entry's backlog stays under 10 rounds) brought
the sent entries to 3.7 steps and the loss after 300 steps from 2.79-2.94 to 2.44-2.45, dense
2.37-2.41 (experiments/REPORT.md, "What holds the LM on its plateau").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_step
from torch.optim.optimizer import _get_fused_kernels_supported_devices
from torch.optim.sgd import sgd as sgd_step

from ssfusion_lightning.sparsifiers.memory import (
    MEMORIES,
    LocallyClipped,
    Memory,
    _checked_commit,
    _zero_at,
    check_finite,
    validated_clip_norm,
    validated_feedback,
)
from ssfusion_lightning.sparsifiers.selection import all_finite

#: the group settings an Adam step has beyond its learning rate and decoupled weight decay: they must
#: be plain Adam's for the taken-over step to be the optimizer's
_PLAIN_ADAM = {"amsgrad": False, "maximize": False}


class AveragedUpdate(torch.optim.SGD):
    """The step that applies the ranks' averaged Adam update held in ``.grad``:
    p <- p - lr * (update + weight_decay * p), which is AdamW's decoupled decay
    p (1 - lr wd) - lr update. Built over the replaced optimizer's parameter groups themselves.

    While DDP's reducer runs the dense rounds (``AdamMemory.hand_to_optimizer``), ``.grad`` holds the
    averaged gradient and this step is the replaced optimizer's own, with the moments in this
    optimizer's state (the replaced one shares its state and groups), so a checkpoint holds them."""

    def __init__(self, replaced: torch.optim.Optimizer) -> None:
        for group in replaced.param_groups:
            group.update(momentum=0.0, dampening=0.0, nesterov=False)
        super().__init__(replaced.param_groups, lr=replaced.defaults["lr"])
        self.replaced_name = type(replaced).__name__
        self.replaced = replaced
        self.replaced.state = self.state
        #: the gradients are averaged gradients, not averaged updates: the step is the replaced one's
        self.steps_adam = False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        # an LR scheduler moved over from the replaced optimizer checks, at its first step, that the
        # optimizer stepped first, through what its wrapper of ``step`` records: this step records it
        self._opt_called = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # the hand-off to DDP's reducer happens in the backward
        if self.steps_adam:
            self.replaced.step()
        else:
            for group in self.param_groups:
                self._apply_averaged_update(group)
        return loss

    def _apply_averaged_update(self, group: dict[str, Any]) -> None:
        """p <- p - lr (update + weight_decay p) for the group's parameters with a gradient, in one
        pass of torch's fused SGD step where it has one for them (SGD's default on the host is a loop
        of two passes a tensor, one of them into a fresh tensor the size of the weight, whose pages the
        kernel faults in every step), else in SGD's own step."""
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        sgd_step(
            params, grads, [None] * len(params), has_sparse_grad=any(g.is_sparse for g in grads),
            fused=True if _fused_sgd_runs(params, grads) else None,  # None: SGD's default for the device
            weight_decay=group["weight_decay"], momentum=0.0, lr=group["lr"], dampening=0.0, nesterov=False, maximize=False,
        )

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # loading replaces the state and the group dicts: the replaced optimizer shares the new ones
        super().load_state_dict(state_dict)
        self.replaced.state, self.replaced.param_groups = self.state, self.param_groups
        self.steps_adam = any("exp_avg" in state for state in self.state.values())


def adam_settings(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[tuple[float, float], float]:
    """The betas and eps ``memory="adam"`` takes over from ``optimizers``; ValueError, saying why,
    where it cannot compute their step: another optimizer, AMSGrad or maximize, Adam's coupled
    weight decay, or parameter groups with different betas or eps."""
    names = sorted({type(opt).__name__ for opt in optimizers if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))})
    if names or not optimizers:
        raise ValueError(
            f"memory='adam' computes an Adam or AdamW optimizer's step, but the optimizers are {', '.join(names) or 'none'}; "
            "use memory='residual', or memory='dgc' with SGD and momentum"
        )
    settings = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for key, plain in _PLAIN_ADAM.items():
                if bool(group.get(key, plain)) != plain:
                    raise ValueError(f"memory='adam' computes plain Adam's step, but the optimizer has {key}=True; set {key}=False")
            coupled = isinstance(opt, torch.optim.Adam) and not group.get("decoupled_weight_decay", False)
            if coupled and group.get("weight_decay"):
                raise ValueError(
                    f"memory='adam' applies weight decay decoupled (AdamW's), but the optimizer is Adam with "
                    f"weight_decay={group['weight_decay']!r} added to the gradient; use AdamW (or Adam with "
                    "decoupled_weight_decay=True), or weight_decay=0"
                )
            settings.add((tuple(float(b) for b in group["betas"]), float(group["eps"])))
    if len(settings) > 1:
        raise ValueError(
            f"memory='adam' keeps one pair of moments per tensor, but the parameter groups use different betas and eps "
            f"{sorted(settings)}; use one setting for every group"
        )
    (betas, eps), = settings
    return betas, eps


@dataclass
class _Compensated:
    """``compensate``'s tensor for ``grad`` and the moments it stepped (temporaries the commit keeps
    as the state), and both tensors' versions when it returned."""

    grad: Tensor
    grad_version: int
    tensor: Tensor
    version: int
    first: Tensor
    second: Tensor
    step: int


@MEMORIES.register("adam")
class AdamMemory(LocallyClipped, Memory):
    """Error feedback on each rank's Adam update (see the module's notes).

    ``clip_norm``: DGC's local clipping of each gradient before it enters the moments (scaled to
    L2 norm ``clip_norm / sqrt(P)`` when larger; None/0 disables). Betas and eps are the
    optimizer's, set by ``take_over``. Refuses a GradScaler's scaled gradients.
    ``feedback``: the fraction of the unsent update kept as the residual, in (0, 1]. At 1 (error
    feedback) nothing is lost; below 1 an entry's backlog stays under 1 / (1 - feedback) rounds
    of updates (see the module's notes).
    ``residual(key)`` is r: at every step, r == feedback * (the compensated tensor - sent), and
    at feedback 1, sent + r == the compensated tensor exactly.

    A dense slot sends u + r whole and keeps no residual: every position sent every round is
    local-moment Adam, its moments never lost. Where DDP's reducer takes such rounds over
    (``hand_to_optimizer``), the ranks' averaged moments become the replaced optimizer's, which then
    steps on the averaged gradient: the first moment is the same average, the second the average of
    the ranks' squares, which exceeds the square of the averaged gradient by the ranks' spread.
    """

    dense_as_is = False

    def __init__(self, clip_norm: float | None = None, feedback: float = 1.0) -> None:
        self.clip_norm = validated_clip_norm(clip_norm)
        self.feedback = validated_feedback(feedback)
        self.betas = (0.9, 0.999)
        self.eps = 1e-8
        self.world_size = 1
        self.first_moments: dict[str, Tensor] = {}
        self.second_moments: dict[str, Tensor] = {}
        self.steps: dict[str, int] = {}
        self.residuals: dict[str, Tensor] = {}
        #: keys whose stored residual still owes its last commit's ``feedback`` factor: the next
        #: ``compensate`` applies it in the pass that copies the residual anyway (a pass less a round,
        #: 4.5 of 57 ms on gpt2_10m); every other reader applies it first (``_owed``)
        self._unkept: set[str] = set()
        self._clip_factors: dict[str, float] = {}
        #: compensate's tensors per key until its commit keeps them as the state (the moments it
        #: stepped, u + r as the residual): the commit computes nothing again
        self._compensated: dict[str, _Compensated] = {}
        #: per key, the host tensors its last commit replaced, for the next compensate to compute in:
        #: fresh host tensors the size of a transformer's weights come as fresh pages (on gpt2_10m
        #: 20,705 page faults and about 30 ms a round); a GPU's caching allocator reuses its blocks
        self._spares: dict[str, list[Tensor]] = {}
        self._replacements: list[AveragedUpdate] = []
        self._optimizer_steps_every_tensor = False

    # ------------------------------------------------------------ the optimizer
    def take_over(self, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor] = ()) -> list[AveragedUpdate]:
        """This memory computes the Adam step of every optimizer in ``optimizers`` (Adam or AdamW,
        one pair of betas and one eps): their betas and eps move here, and each one's replacement
        (``AveragedUpdate``) is returned, in order. ``params``: the tensors this memory keeps moments
        for; where the replacements step every one, DDP's reducer may take the dense rounds over
        (``ddp_can_take_over``)."""
        self.betas, self.eps = adam_settings(optimizers)
        self._replacements = [AveragedUpdate(opt) for opt in optimizers]
        stepped = {id(param) for update in self._replacements for group in update.param_groups for param in group["params"]}
        self._optimizer_steps_every_tensor = bool(params) and all(id(param) in stepped for param in params)
        return list(self._replacements)

    @property
    def ddp_can_take_over(self) -> bool:
        """The replaced optimizers step every tensor, and no clipping only this memory would do."""
        return self._optimizer_steps_every_tensor and not self.clips_only_here

    @property
    def in_optimizer(self) -> bool:
        return any(update.steps_adam for update in self._replacements)

    def _owners(self) -> dict[int, tuple[AveragedUpdate, dict[str, Any]]]:
        """id(parameter) -> the replacement that steps it, and its group there."""
        return {
            id(param): (update, group) for update in self._replacements for group in update.param_groups for param in group["params"]
        }

    def hand_to_optimizer(self, params: Mapping[str, Tensor], average_: Callable[[list[Tensor]], None]) -> None:
        """The ranks' averaged moments (and the step count, the same on every rank) become the replaced
        optimizer's state, which from this round on steps on DDP's averaged gradient; this memory keeps
        none. A tensor without moments gets none: the optimizer starts them as a fresh key here would.
        Nothing moves where the optimizer steps Adam already (a run resumed from a checkpoint written
        while handed off)."""
        if self.in_optimizer:
            return
        keys = [key for key in params if key in self.first_moments]
        average_([self.first_moments[key] for key in keys] + [self.second_moments[key] for key in keys])
        owners = self._owners()
        for key in keys:
            param = params[key]
            owner, group = owners[id(param)]
            # where torch's Adam keeps the count: on the parameter's device for its capturable and fused steps
            on_param = group.get("capturable") or group.get("fused")
            owner.state[param] = {
                "step": torch.tensor(float(self.steps[key]), dtype=_scalar_dtype(), device=param.device if on_param else None),
                "exp_avg": self.first_moments[key],
                "exp_avg_sq": self.second_moments[key],
            }
        for update in self._replacements:
            update.steps_adam = True
        self.reset()

    def take_from_optimizer(self, params: Mapping[str, Tensor]) -> bool:
        """The replaced optimizer's moments (the same on every rank) become each rank's here, and the
        replacements apply averaged updates again. Also after loading a checkpoint written while DDP's
        reducer ran the rounds."""
        if not self.in_optimizer:
            return False
        self._compensated.clear()
        self._spares.clear()
        owners = self._owners()
        for key, param in params.items():
            owner = owners.get(id(param))
            state = None if owner is None else owner[0].state.pop(param, None)
            if state and "exp_avg" in state:
                self.first_moments[key] = state["exp_avg"].detach().contiguous()
                self.second_moments[key] = state["exp_avg_sq"].detach().contiguous()
                self.steps[key] = int(state["step"])
        for update in self._replacements:
            update.steps_adam = False
        return True

    # ------------------------------------------------------------ one round
    def _fresh(self, key: str, grad: Tensor) -> bool:
        moment = self.first_moments.get(key)
        return moment is None or moment.shape != grad.shape or moment.dtype != grad.dtype

    def _add_adam_steps_(self, totals: list[Tensor], grads: list[Tensor], firsts: list[Tensor], seconds: list[Tensor], steps: list[int]) -> None:
        """In place, per tensor: the moments stepped with the gradient, and the total plus Adam's
        update from them, bias-corrected at step + 1. One call of torch's fused Adam step (a single
        pass over the four tensors, where the moments and the update took about a dozen) over the
        tensors: its parameter is the total and its learning rate -1."""
        if not totals:
            return
        beta1, beta2 = self.betas
        counts = list(torch.tensor([float(step) for step in steps], dtype=_scalar_dtype(), device=totals[0].device).unbind())
        adam_step(
            totals, grads, firsts, seconds, [], counts,
            foreach=False, fused=_fused_kernel_runs(totals[0]),
            amsgrad=False, beta1=beta1, beta2=beta2, lr=-1.0, weight_decay=0.0, eps=self.eps, maximize=False,
        )

    def _stepped_in_place(self, key: str, grad: Tensor) -> Tensor:
        """The commit computing the round itself: the stored moments stepped with ``grad`` and the
        update added to the residual (started at zero for a fresh key), which is returned."""
        if self._fresh(key, grad):
            self.first_moments[key], self.second_moments[key] = torch.zeros_like(grad), torch.zeros_like(grad)
            self.steps[key] = 0
            self._drop_residual(key)
        residual = self._owed(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros_like(self.first_moments[key])
        self._add_adam_steps_([residual], [grad], [self.first_moments[key]], [self.second_moments[key]], [self.steps[key]])
        self.steps[key] += 1
        return residual

    def _kept(self, key: str, grad: Tensor) -> _Compensated | None:
        """What ``compensate`` computed for this very gradient, where neither its tensor nor the
        gradient changed since: the state the commit keeps (the residual before the sent positions
        are zeroed, and the stepped moments)."""
        held = self._compensated.pop(key, None)
        if held is None or held.grad is not grad or held.grad._version != held.grad_version:
            return None
        return held if held.tensor._version == held.version else None

    def _scratch(self, key: str) -> list[Tensor]:
        """Three tensors in the layout of the key's moments: the spares its last commit left, else new."""
        like = self.first_moments[key]
        spares = [t for t in self._spares.pop(key, []) if t.shape == like.shape and t.dtype == like.dtype and t.device == like.device][:3]
        return spares + [torch.empty_like(like) for _ in range(3 - len(spares))]

    def _adopt(self, key: str, held: _Compensated, residual: Tensor | None) -> None:
        """compensate's moments (and ``residual``, or none) become the key's state; the tensors they
        replace become its spares on the host."""
        replaced = [self.first_moments.get(key), self.second_moments.get(key), self._drop_residual(key)]
        self.first_moments[key], self.second_moments[key], self.steps[key] = held.first, held.second, held.step
        if residual is not None:
            self.residuals[key] = residual
        self._spares[key] = [t for t in replaced if t is not None and t.device.type == "cpu"]

    def compensate(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return self.compensate_many([key], [grad], loss_scale)[0]

    def compensate_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> list[Tensor]:
        """u + r per key (u where nothing is owed), computed in copies of the state: the stored
        moments and residual are untouched until the commit, which keeps the copies."""
        _refuse_scale(loss_scale)
        totals, firsts, seconds, steps = [], [], [], []
        clipped = self._clipped_contiguous(keys, grads)  # the fused step reads every tensor as contiguous memory
        for key, grad, like in zip(keys, grads, clipped):
            if self._fresh(key, grad):
                firsts.append(torch.zeros_like(like))
                seconds.append(torch.zeros_like(like))
                totals.append(torch.zeros_like(like))
                steps.append(0)
                continue
            residual = self.residuals.get(key)
            first, second, total = self._scratch(key)
            firsts.append(first.copy_(self.first_moments[key]))
            seconds.append(second.copy_(self.second_moments[key]))
            if residual is None:
                totals.append(total.zero_())
            elif key in self._unkept:  # the same bits as the commit's multiply in place, in the copy's pass
                totals.append(torch.mul(residual, self.feedback, out=total))
            else:
                totals.append(total.copy_(residual))
            steps.append(self.steps[key])
        self._add_adam_steps_(totals, clipped, firsts, seconds, steps)
        for key, grad, total, first, second, step in zip(keys, grads, totals, firsts, seconds, steps):
            self._compensated[key] = _Compensated(grad, grad._version, total, total._version, first, second, step + 1)
        return totals

    def update(
        self, key: str, grad: Tensor, sent_indices: Tensor, loss_scale: Tensor | None = None, verified: bool = False
    ) -> None:
        _refuse_scale(loss_scale)
        if not verified:
            check_finite(key, grad, "gradient")
        residual = self._committed(key, grad, owes=True)
        # a finite update comes from a finite first moment, but a second moment overflowed to inf
        # gives a finite update (zero): that one is checked whatever the caller verified
        moments = [self.second_moments[key]] if verified else [self.first_moments[key], self.second_moments[key], residual]
        _checked_commit(key, moments, self._states)
        _zero_at(residual, sent_indices)
        self._defer_keep(key)

    def update_many(
        self,
        keys: Sequence[str],
        grads: Sequence[Tensor],
        sent_indices: Sequence[Tensor],
        loss_scale: Tensor | None = None,
        verified: bool = False,
    ) -> None:
        """``update`` of each key, with one check of the second moments for all of them: a check a
        key cost a buffer of small tensors more than their commit."""
        if not verified or len(keys) < 2:
            return super().update_many(keys, grads, sent_indices, loss_scale, verified)
        _refuse_scale(loss_scale)
        residuals = [self._committed(key, grad, owes=True) for key, grad in zip(keys, grads)]
        for key, residual, sent in zip(keys, residuals, sent_indices):
            _zero_at(residual, sent)
            self._defer_keep(key)
        if not bool(all_finite([self.second_moments[key] for key in keys])):
            self._drop_overflowed(keys, lambda key: [self.second_moments[key]])
        return None

    def compensate_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> Tensor:
        return self.compensate(key, grad, loss_scale)

    def compensate_dense_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> list[Tensor | None]:
        """A buffer's dense slots in one fused call: a call per key cost the small tensors of a
        language model more than their arithmetic."""
        return list(self.compensate_many(keys, grads, loss_scale))

    def settle_dense(self, key: str, grad: Tensor, loss_scale: Tensor | None = None) -> None:
        _refuse_scale(loss_scale)
        check_finite(key, grad, "gradient")
        self._committed(key, grad, owes=False)
        _checked_commit(key, [self.first_moments[key], self.second_moments[key]], self._states)

    def settle_dense_many(self, keys: Sequence[str], grads: Sequence[Tensor], loss_scale: Tensor | None = None) -> None:
        """``settle_dense`` of each key, with one check of the gradients and one of the moments."""
        if len(keys) < 2 or not bool(all_finite(list(grads))):
            return super().settle_dense_many(keys, grads, loss_scale)  # names the first non-finite one
        _refuse_scale(loss_scale)
        for key, grad in zip(keys, grads):
            self._committed(key, grad, owes=False)
        if not bool(all_finite([self.first_moments[key] for key in keys] + [self.second_moments[key] for key in keys])):
            self._drop_overflowed(keys, lambda key: [self.first_moments[key], self.second_moments[key]])
        return None

    def _drop_overflowed(self, keys: Sequence[str], checked: Callable[[str], list[Tensor]]) -> None:
        """After a batched commit: every key with a non-finite ``checked`` state loses its state, as
        one at a time, and the first one's error is raised."""
        first_error = None
        for key in keys:
            try:
                _checked_commit(key, checked(key), self._states)
            except FloatingPointError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _committed(self, key: str, grad: Tensor, owes: bool) -> Tensor | None:
        """The round of ``grad`` committed: the moments stepped (compensate's, where it computed
        them for this very gradient) and, where the key ``owes``, u + r kept as the residual, which
        is returned before its sent positions are zeroed; else the key owes nothing."""
        held = self._kept(key, grad)
        if held is not None:  # compensate stepped the moments and added the update: its tensors become the state
            self._clip_factors.pop(key, None)
            self._adopt(key, held, residual=held.tensor if owes else None)
            return held.tensor if owes else None
        residual = self._stepped_in_place(key, self._clipped(key, grad, None, commit=True).contiguous())
        if owes:
            return residual
        self._drop_residual(key)
        return None

    def _defer_keep(self, key: str) -> None:
        """After the sent positions are zeroed: ``feedback`` of the rest is kept, applied later (``_unkept``)."""
        if self.feedback != 1.0:
            self._unkept.add(key)

    def _owed(self, key: str) -> Tensor | None:
        """The key's residual, with a deferred ``feedback`` factor applied in place."""
        residual = self.residuals.get(key)
        if key in self._unkept:
            self._unkept.discard(key)
            if residual is not None:
                residual.mul_(self.feedback)
        return residual

    def _drop_residual(self, key: str) -> Tensor | None:
        self._unkept.discard(key)
        return self.residuals.pop(key, None)

    def _all_owed(self) -> dict[str, Tensor]:
        for key in list(self._unkept):
            self._owed(key)
        return self.residuals

    @property
    def _states(self) -> list[dict[str, Any]]:
        return [self.first_moments, self.second_moments, self.residuals, self.steps]

    # ------------------------------------------------------------ state
    def residual(self, key: str) -> Tensor | None:
        return self._owed(key)

    def owed_states(self) -> list[dict[str, Tensor]]:
        return [self._all_owed()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "first_moments": {k: v.detach().cpu().clone() for k, v in self.first_moments.items()},
            "second_moments": {k: v.detach().cpu().clone() for k, v in self.second_moments.items()},
            "steps": {k: torch.tensor(v) for k, v in self.steps.items()},
            "residuals": {k: v.detach().cpu().clone() for k, v in self._all_owed().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = {name: {k: v.clone() for k, v in state[name].items()} for name in ("first_moments", "second_moments", "residuals")}
        for name, tensors in loaded.items():
            for key, value in tensors.items():
                check_finite(key, value, f"saved {name.replace('_', ' ')[:-1]}")
        steps = {k: int(v) for k, v in state["steps"].items()}
        if set(steps) != set(loaded["first_moments"]) or set(steps) != set(loaded["second_moments"]):
            raise ValueError("memory='adam' state is corrupted: every key needs its two moments and its step count")
        self.first_moments, self.second_moments = loaded["first_moments"], loaded["second_moments"]
        self.residuals, self.steps = loaded["residuals"], steps
        self._unkept.clear()
        self._clip_factors.clear()
        self._compensated.clear()
        self._spares.clear()

    def reset(self) -> None:
        for state in self._states:
            state.clear()
        self._unkept.clear()
        self._clip_factors.clear()
        self._compensated.clear()
        self._spares.clear()


#: the refusal of a GradScaler's scaled gradients, also raised by the strategy at setup
SCALED_GRADIENTS_REFUSED = (
    "memory='adam' takes unscaled gradients, but fp16 mixed precision's GradScaler scales them; "
    "use precision='bf16-mixed' or '32-true' with memory='adam'"
)


def _fused_kernel_runs(tensor: Tensor) -> bool:
    """Whether torch has fused optimizer steps (Adam's, SGD's) for ``tensor``'s device and dtype."""
    return tensor.device.type in _get_fused_kernels_supported_devices() and tensor.dtype in _FUSED_DTYPES


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_sgd_runs(params: Sequence[Tensor], grads: Sequence[Tensor]) -> bool:
    """Whether torch's fused SGD step takes these tensors: of one device and dtype it has a kernel
    for, each parameter dense in memory and its gradient laid out alike (the kernel reads both as
    flat memory, whatever their strides say)."""
    if not params:
        return False
    first = params[0]
    return _fused_kernel_runs(first) and all(
        p.device == first.device and p.dtype == g.dtype == first.dtype and not g.is_sparse
        and g.stride() == p.stride() and _dense_in_memory(p)
        for p, g in zip(params, grads)
    )


def _dense_in_memory(tensor: Tensor) -> bool:
    return any(tensor.is_contiguous(memory_format=form) for form in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d))


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's Adam keeps its step count in off the parameter's device."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _refuse_scale(loss_scale: Tensor | None) -> None:
    if loss_scale is not None:
        raise ValueError(SCALED_GRADIENTS_REFUSED)
