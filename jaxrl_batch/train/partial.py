"""Partial rollouts (`rollout.partial`): the continuous engine's slots never drain between steps.

The requests form one stream in the synchronous run's order: prompt step t's P problems (the same as that run's
step t) x G samples, t = 0, 1, .... Step s admits requests of prompt steps up to s + `rollout.max_lookahead`, so
when step s's own sequences end, its slots go on with later prompts instead of idling behind the stragglers. Step
s's generation stops at the first chunk boundary where (a) at least P groups are complete (all G samples ended,
counting those finished in earlier steps and not yet trained) and (b) `rollout.partial_budget` decode steps have
run this step (0: no minimum). It trains on the P oldest complete groups (prompt step, then group); the other
finished groups wait for the next step, and the sequences still in flight are carried over. With
`rollout.carry_kv` (PipelineRL's in-flight weight update) they keep their slot and its KV cache: the next step's
engine call continues them under the new weights on the keys/values the older weights wrote, and new requests take
only the free slots. Without it (AReaL's way) they are re-prefilled from their prompt and tokens under the new
weights and continue. Every token records the step whose policy sampled it, so the loss can use the behaviour
log-probs (`rl.old_logp=sampler`, or `trainer` with `rl.tis_cap`) and the metrics report the lag.

A token at index t of request u (u = prompt step x B + row) is drawn with the key fold_in(fold_in(k, u), t),
k = `streams.sampling_key(streams.partial_key_data(seed))`: where a sequence is cut does not change its draws.
The carried sequences, the finished groups waiting and the stream's position are run state, saved in every
checkpoint's meta (`state_dict`), so a resumed run continues exactly; the kept KV cache is not saved: after a
resume the carried sequences are re-prefilled once under the restored weights, then kept again (with carry_kv the
resumed run's tokens after the restart differ from the uninterrupted run's, within the lag both already have).

Host crossings of a step: the request table up ("prompts": prompts, carried tokens and their log-probs), one
upload and one download per chunk ("admit", "slots"), every request's tokens down ("tokens"), the trained batch up
with its rewards ("rewards"), the metrics down.
"""
import logging
import time
from typing import NamedTuple

import numpy as np

from jaxrl_batch.model import compute_copy
from jaxrl_batch.rl.rollouts import Rollouts
from jaxrl_batch.runtime import sharding, streams, transfer
from jaxrl_batch.sampling import continuous
from jaxrl_batch.train import samples_log
from jaxrl_batch.train.collector import Collector, sampling_key
from jaxrl_batch.train.step_row import RolloutStats, group_zero_std_frac, trained_rewards


def capacity(slots: int, batch_size: int, num_prompts: int, lookahead: int) -> tuple[int, int]:
  """(requests, prompt rows) of one engine call: the carried sequences (at most `slots`, each with a prompt row of
  its own) and new requests of up to lookahead + 1 prompt steps (B requests, P prompt rows each). Fixed shapes:
  one program per run (`aot` compiles them)."""
  return slots + (lookahead + 1) * batch_size, slots + (lookahead + 1) * num_prompts


class _Table(NamedTuple):
  """One engine call's requests on the host, in `continuous.decode`'s order: the Q prompt rows (prompt_QxP,
  valid_QxP), then per request (R rows) its prompt row, uid, token budget, tokens and log-probs so far and their
  count (0 for a new request)."""
  prompt_QxP: np.ndarray
  valid_QxP: np.ndarray
  prompt_R: np.ndarray
  uid_R: np.ndarray
  budget_R: np.ndarray
  tokens_RxN: np.ndarray
  logps_RxN: np.ndarray
  held_R: np.ndarray


def _seq(uid, prompt_row, problem, tokens, logps, versions, length, eos, reward=None):
  return dict(uid=int(uid), prompt=prompt_row, problem=problem, tokens=tokens, logps=logps, versions=versions,
              length=int(length), eos=bool(eos), reward=reward)


class PartialCollector(Collector):
  """`Collector` whose engine keeps sequences in flight across steps (see the module docstring)."""
  carries_rollouts = True

  def __init__(self, exp):
    super().__init__(exp)
    cfg = exp.config.rollout
    if exp.engine.engine != "continuous":
      raise ValueError("rollout.partial=True carries sequences across steps in the continuous engine's slots: set "
                       "sampling.engine='continuous'.")
    if exp.model_cfg.routing_replay:
      raise ValueError("model.routing_replay=True with rollout.partial=True: the routing of carried sequences is not "
                       "recorded across steps yet, so nothing would be replayed. Turn one of them off.")
    if self.member.algo.dynamic_sampling:
      raise ValueError("rollout.partial=True does not combine with rl.dynamic_sampling yet: turn one of them off.")
    if cfg.carry_kv and exp.engine.page_size:
      raise ValueError("rollout.carry_kv=True keeps carried sequences in the slot cache; a paged cache "
                       "(sampling.page_size > 0) rebuilds its prompt pages every step. Set rollout.carry_kv=False "
                       "(carried sequences re-prefilled) or sampling.page_size=0.")
    if cfg.partial_budget < 0 or cfg.max_lookahead < 0:
      raise ValueError(f"rollout.partial_budget={cfg.partial_budget} and rollout.max_lookahead={cfg.max_lookahead} "
                       "must be >= 0.")
    self.budget, self.lookahead, self.carry_kv = int(cfg.partial_budget), int(cfg.max_lookahead), bool(cfg.carry_kv)
    m = self.member
    self.slots = self.slots or m.batch_size
    # Requests and prompt rows of one call: carried + new.
    self.capacity, self.prompt_capacity = capacity(self.slots, m.batch_size, m.num_prompts, self.lookahead)
    self.next_uid = 0  # the stream's first request not yet started
    self.carried: list[dict] = []  # in flight at the last stop: uid, prompt row, tokens so far, slot (carry_kv)...
    self.kept: continuous.KeptSlots | None = None  # carry_kv: the engine's slots at the last stop (not saved)
    self.finished: dict[int, dict] = {}  # ended, not yet trained, by uid
    self._problems: dict[int, list] = {}

  # -- run state ------------------------------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """The JSON-able run state: the stream's position, the carried sequences and the finished ones waiting."""
    def plain(seq):
      return dict(uid=seq["uid"], tokens=seq["tokens"][:seq["length"]].tolist(),
                  logps=seq["logps"][:seq["length"]].tolist(), versions=seq["versions"][:seq["length"]].tolist(),
                  eos=seq["eos"], reward=seq["reward"])
    return dict(next_uid=self.next_uid, carried=[plain(s) for s in self.carried],
                finished=[plain(s) for s in self.finished.values()])

  def load_state_dict(self, state: dict) -> None:
    n = self.exp.response_len

    def full(values, dtype, fill):
      out = np.full(n, fill, dtype)
      out[:len(values)] = values
      return out

    def seq(d):
      prompt_row, problem = self._request(d["uid"])
      return _seq(d["uid"], prompt_row, problem, full(d["tokens"], np.int32, self.exp.tokenizer.pad_id),
                  full(d["logps"], np.float32, 0.0), full(d["versions"], np.int32, 0), len(d["tokens"]), d["eos"],
                  d["reward"])
    self.next_uid = int(state["next_uid"])
    self.carried = [seq(d) for d in state["carried"]]  # no slot: re-prefilled once
    self.kept = None
    self.finished = {d["uid"]: seq(d) for d in state["finished"]}

  # -- the stream -----------------------------------------------------------------------------------------------

  def _request(self, uid: int):
    """(prompt row: tokens_P, valid_P; problem) of stream request `uid`."""
    m = self.member
    t, row = divmod(uid, m.batch_size)
    if t not in self._problems:
      problems = self.exp.task.train_problems(streams.rl_prompt_seed(m.seed, 0), t, m.num_prompts)
      self._problems[t] = (problems, self.exp.encode_prompts(problems))
      for old in [k for k in self._problems if k < t - self.lookahead - 2]:
        del self._problems[old]
    problems, (tokens_PxL, valid_PxL) = self._problems[t]
    i = row // m.group_size
    return (tokens_PxL[i], valid_PxL[i]), problems[i]

  # -- one step -------------------------------------------------------------------------------------------------

  def _decode(self, graphdef, params, step: int):
    """One call of the engine for step `step`: continues the carried sequences and starts the stream's next
    requests until `_stop`; refreshes `carried`. Returns (EngineStats, the sequences that ended, not yet scored)."""
    exp = self.exp
    reqs = self._call_requests(step)
    table = self._request_table(reqs)
    prompt_QxP, valid_QxP, requests, key_data = self._upload_requests(table)
    out = continuous.decode(graphdef, params, prompt_QxP, valid_QxP, requests, table.held_R, range(len(reqs)),
                            sampling_key(key_data), eos_id=exp.stop_id, sampling=exp.strategy, engine=exp.engine,
                            slots=self.slots, stop=self._stop(table.uid_R), row_sharding=self._row_sharding,
                            kept=self._kept_slots())
    self.kept = out.kept if self.carry_kv else None
    ended, self.carried = self._sort_out(reqs, out, table.held_R, step)
    return out.stats, ended

  def _call_requests(self, step: int) -> list[dict]:
    """The requests of an engine call: the carried sequences, then the stream's next requests up to prompt step
    `step` + lookahead, as many as the table holds (uid, prompt row, problem)."""
    end_uid = min((step + self.lookahead + 1) * self.member.batch_size,
                  self.next_uid + self.capacity - len(self.carried))
    return self.carried + [dict(zip(("uid", "prompt", "problem"), (u, *self._request(u))))
                           for u in range(self.next_uid, end_uid)]

  def _prompt_rows(self, reqs: list[dict]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(prompt_QxP, valid_QxP, the prompt row of each request): a carried request has a row of its own; new ones
    share their group's (the first new one takes a row even mid-group)."""
    exp = self.exp
    prompts, prompt_R = [], []
    for i, req in enumerate(reqs):
      if i <= len(self.carried) or req["uid"] % self.member.group_size == 0:
        prompts.append(req["prompt"])
      prompt_R.append(len(prompts) - 1)
    prompt_QxP = np.full((self.prompt_capacity, exp.prompt_len), exp.tokenizer.pad_id, np.int32)
    valid_QxP = np.zeros((self.prompt_capacity, exp.prompt_len), bool)
    for i, (tokens_P, valid_P) in enumerate(prompts):
      prompt_QxP[i], valid_QxP[i] = tokens_P, valid_P
    return prompt_QxP, valid_QxP, prompt_R

  def _request_table(self, reqs: list[dict]) -> _Table:
    """The host table of an engine call's requests at the fixed capacity (one program per run): the carried
    sequences first, holding their tokens so far, then the new requests, holding none."""
    n, pad, r = self.exp.response_len, self.exp.tokenizer.pad_id, self.capacity
    prompt_QxP, valid_QxP, prompt_R = self._prompt_rows(reqs)
    table = _Table(prompt_QxP, valid_QxP, prompt_R=np.zeros(r, np.int32), uid_R=np.zeros(r, np.int32),
                   budget_R=np.full(r, n, np.int32), tokens_RxN=np.full((r, n), pad, np.int32),
                   logps_RxN=np.zeros((r, n), np.float32), held_R=np.zeros(r, np.int32))
    table.prompt_R[:len(reqs)], table.uid_R[:len(reqs)] = prompt_R, [req["uid"] for req in reqs]
    for i, seq in enumerate(self.carried):
      table.tokens_RxN[i], table.logps_RxN[i], table.held_R[i] = seq["tokens"], seq["logps"], seq["length"]
    return table

  def _upload_requests(self, table: _Table):
    """The table on the device, in one transfer ("prompts") with the stream's key data: (prompt_QxP, valid_QxP,
    `continuous.Requests`, key data); the prompts replicated, the requests split by row."""
    mesh = self.exp.mesh
    rows, replicated = sharding.batch_sharding(mesh, 1), sharding.replicated(mesh)
    device = transfer.to_device("prompts", (*table, streams.partial_key_data(self.member.seed)),
                                (replicated,) * 2 + (rows,) * 3 + (sharding.batch_sharding(mesh, 2),) * 2 +
                                (rows, replicated))
    return device[0], device[1], continuous.Requests(*device[2:8]), device[8]

  def _kept_slots(self) -> continuous.KeptSlots | None:
    """carry_kv: the slots the last call kept, each named under its carried sequence's row of this call; else None."""
    if self.kept is None:
      return None
    slot_R = np.full(self.capacity, -1, np.int64)
    slot_R[:len(self.carried)] = [seq.get("slot", -1) for seq in self.carried]
    return self.kept._replace(slot_R=slot_R)

  def _stop(self, uid_R: np.ndarray):
    """The engine's test after each chunk: this step's `partial_budget` decode steps run and P groups complete,
    counting the sequences ended in this call."""
    def stop(ended_R, decode_steps):
      ended = {int(uid_R[i]) for i in np.flatnonzero(ended_R)}
      return decode_steps >= self.budget and len(self._complete_groups(ended)) >= self.member.num_prompts
    return stop

  def _sort_out(self, reqs: list[dict], out: continuous.Decoded, held_R: np.ndarray,
                step: int) -> tuple[list[dict], list[dict]]:
    """(ended, still in flight) of an engine call's started requests, their new tokens stamped with `step` (and
    under carry_kv an in-flight one's slot); moves the stream past the new requests started."""
    n = self.exp.response_len
    tokens_RxN, logps_RxN, lengths_R, eos_R = transfer.to_host("tokens", tuple(out.outputs)[:4])
    ended, carried = [], []
    for i, req in enumerate(reqs):
      held = int(out.held_R[i])
      if not out.ended_R[i] and held == 0:
        break  # never admitted (admission is in stream order): it and those after it start at the next call
      if i >= len(self.carried):
        self.next_uid = req["uid"] + 1
      length = int(lengths_R[i]) if out.ended_R[i] else held
      versions = req["versions"].copy() if "versions" in req else np.zeros(n, np.int32)
      versions[int(held_R[i]):length] = step
      seq = _seq(req["uid"], req["prompt"], req["problem"], tokens_RxN[i].copy(), logps_RxN[i].copy(), versions,
                 length, out.ended_R[i] and eos_R[i])
      if self.kept is not None and not out.ended_R[i]:
        seq["slot"] = int(self.kept.slot_R[i])
      (ended if out.ended_R[i] else carried).append(seq)
    return ended, carried

  def _complete_groups(self, also_ended: set) -> list[int]:
    """First uids of the groups whose G samples have all ended (waiting in `finished`, or in `also_ended`)."""
    g = self.member.group_size
    ended = set(self.finished) | also_ended
    return sorted(u for u in ended if u % g == 0 and all(u + j in ended for j in range(g)))

  def collect(self, graphdef, params, step: int) -> tuple[Rollouts, RolloutStats]:
    """The P oldest complete groups' rollouts (on the device, with their rewards) and the step's statistics."""
    exp, m = self.exp, self.member
    params = compute_copy(params, exp.model_cfg.compute_dtype)  # What the engine reads (`model.compute_copy`).
    t0 = time.time()
    calls, ended = [], []
    while not calls or len(self._complete_groups({s["uid"] for s in ended})) < m.num_prompts:
      engine_stats, now = self._decode(graphdef, params, step)  # more than one call only when the table was full
      calls.append(engine_stats)
      ended += now
    t1 = time.time()
    errors, timeouts = self._score(ended, step)
    reward_s = time.time() - t1
    groups = self._complete_groups(set())[:m.num_prompts]
    batch = [self.finished.pop(u + j) for u in groups for j in range(m.group_size)]
    rollouts, rewards_B, trained_B, examples = self._upload(batch)
    lengths_B = np.array([s["length"] for s in batch])
    mask_BxN = np.arange(exp.response_len)[None, :] < lengths_B[:, None]
    lag_BxN = np.where(mask_BxN, step - np.stack([s["versions"] for s in batch]), 0)
    stats = RolloutStats.of(
        rewards_E=[s["reward"] for s in ended], lengths_E=[s["length"] for s in ended],
        truncated_E=[not s["eos"] for s in ended], engine=calls,
        zero_std_frac=group_zero_std_frac(rewards_B, m.group_size),
        rollout_s=t1 - t0, reward_s=reward_s, samples_generated=len(ended), sampling_rounds=1,
        response_lens=lengths_B.tolist(),
        reward_errors=int(errors), reward_timeouts=int(timeouts), trained_samples=int(trained_B.sum()),
        examples=examples, reprefill_s=sum(c.reprefill_s for c in calls),
        policy_lag_mean=float(lag_BxN.sum() / mask_BxN.sum()), policy_lag_max=int(lag_BxN.max()),
        partial_frac=float(np.mean([len(set(s["versions"][:s["length"]].tolist())) > 1 for s in batch])),
        carried_over=len(self.carried))
    return rollouts, stats

  def _score(self, ended: list[dict], step: int) -> tuple[int, int]:
    """Scores the sequences that ended and moves them to `finished`; (reward errors, timeouts)."""
    if not ended:
      return 0, 0
    mask_ExN = np.arange(self.exp.response_len)[None, :] < np.array([s["length"] for s in ended])[:, None]
    completions = self.exp.decode_responses(np.stack([s["tokens"] for s in ended]), mask_ExN)
    scores = self.exp.scorer.score(completions, [s["problem"] for s in ended])
    failures = scores.failures()
    if failures:
      # Named as its metrics row (`step`: steps done, so step index s trains as row s + 1).
      logging.warning("Step %d: the reward function %s", step + 1, failures)
    for seq, reward in zip(ended, scores.rewards_B):
      seq["reward"] = float(reward)
      self.finished[seq["uid"]] = seq
    return scores.errors, scores.timeouts

  def _upload(self, batch: list[dict]) -> tuple[Rollouts, np.ndarray, np.ndarray, list[dict]]:
    """The trained batch's rollouts on the device, with its rewards after the overlong handling; (rollouts, those
    rewards and trained_B on the host, the logged samples)."""
    exp = self.exp
    lengths_B = np.array([s["length"] for s in batch])
    mask_BxN = np.arange(exp.response_len)[None, :] < lengths_B[:, None]
    truncated_B = np.array([not s["eos"] for s in batch])
    rewards_B, trained_B = trained_rewards(self.member.algo, np.array([s["reward"] for s in batch], np.float32),
                                           lengths_B, truncated_B, exp.response_len)
    shown = batch[:self.log_samples_count]
    texts = exp.decode_responses(np.stack([s["tokens"] for s in shown]), mask_BxN[:len(shown)]) if shown else []
    examples = samples_log.examples([s["problem"] for s in shown], texts, [s["reward"] for s in shown], lengths_B,
                                    truncated_B)
    host = (np.stack([s["prompt"][0] for s in batch]), np.stack([s["prompt"][1] for s in batch]),
            np.stack([s["tokens"] for s in batch]) * mask_BxN + exp.tokenizer.pad_id * ~mask_BxN,
            np.stack([s["logps"] for s in batch]) * mask_BxN, mask_BxN, rewards_B.astype(np.float32), trained_B)
    device = transfer.to_device("rewards", host, tuple(sharding.batch_sharding(exp.mesh, x.ndim) for x in host))
    return Rollouts(*device), rewards_B, trained_B, examples
