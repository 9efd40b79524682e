"""Plausible wrong answers to notebook 03's exercises; each must fail tests/graders/ex03_policies.py.

Each entry: (what the mistake is, old text of solutions/ex03_policies.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # SJFWithAging.remaining / key / order_waiting
    (
        "sjf: remaining goes below 0 once a request outlives its prediction",
        "return max(0.0, self.predicted(req) - req.num_output_tokens)",
        "return self.predicted(req) - req.num_output_tokens",
    ),
    (
        "sjf: remaining ignores the tokens already generated",
        "return max(0.0, self.predicted(req) - req.num_output_tokens)",
        "return max(0.0, self.predicted(req))",
    ),
    (
        "sjf: aging raises the key (waiting makes a request rank worse)",
        "return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)",
        "return self.remaining(req) + self.aging * max(0.0, now - req.arrival_time)",
    ),
    (
        "sjf: no aging at all",
        "return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)",
        "return self.remaining(req)",
    ),
    (
        "sjf: key delegated to the engine's SJF",
        "        return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)\n",
        "        from minillm.core.policies import SJF\n        return SJF.key(self, req, now)\n",
    ),
    (
        "sjf: longest job first",
        "return sorted(waiting, key=lambda r: (self.key(r, now), r.arrival_time))",
        "return sorted(waiting, key=lambda r: (-self.key(r, now), r.arrival_time))",
    ),
    (
        "sjf: ties go to the latest arrival",
        "return sorted(waiting, key=lambda r: (self.key(r, now), r.arrival_time))",
        "return sorted(waiting, key=lambda r: (self.key(r, now), -r.arrival_time))",
    ),
    # MLFQPolicy.order_waiting / pick_victim / preempt_for / on_step
    (
        "mlfq: waiting requests by arrival only (levels ignored)",
        "return sorted(waiting, key=lambda r: (self.level(r), r.arrival_time))",
        "return sorted(waiting, key=lambda r: r.arrival_time)",
    ),
    (
        "mlfq: pick_victim takes the shallowest level",
        "return max(candidates, key=lambda r: (self.level(r), r.admit_seq))",
        "return max(candidates, key=lambda r: (-self.level(r), r.admit_seq))",
    ),
    (
        "mlfq: pick_victim takes the earliest admitted at the deepest level",
        "return max(candidates, key=lambda r: (self.level(r), r.admit_seq))",
        "return max(candidates, key=lambda r: (self.level(r), -r.admit_seq))",
    ),
    (
        "mlfq: preempt_for also pushes out a request at the same level",
        "lower = [r for r in running if self.level(r) > lvl]",
        "lower = [r for r in running if self.level(r) >= lvl]",
    ),
    (
        "mlfq: preempt_for ignores preempt=False",
        "        if not self.preempt:\n            return None\n        lvl = self.level(request)",
        "        lvl = self.level(request)",
    ),
    (
        "mlfq: on_step demotes at most one level per step",
        "            while st[0] < len(self.quanta) and st[1] >= self.quanta[st[0]]:",
        "            if st[0] < len(self.quanta) and st[1] >= self.quanta[st[0]]:",
    ),
    (
        "mlfq: on_step restarts the count at 0 on demotion (the tokens past the quantum are lost)",
        "                st[1] -= self.quanta[st[0]]\n",
        "                st[1] = 0\n",
    ),
    (
        "mlfq: on_step demotes past the last level",
        "            while st[0] < len(self.quanta) and st[1] >= self.quanta[st[0]]:",
        "            while st[1] >= self.quanta[min(st[0], len(self.quanta) - 1)]:",
    ),
    (
        "mlfq: the first call boosts instead of starting the timer",
        "        if self.last_boost is None:\n            self.last_boost = now\n        elif now - self.last_boost",
        "        if self.last_boost is None:\n            self.last_boost = -1e9\n        if now - self.last_boost",
    ),
    (
        "mlfq: the boost timer is never restarted",
        "            self.num_boosts += 1\n            self.last_boost = now\n",
        "            self.num_boosts += 1\n",
    ),
    (
        "mlfq: the boost forgets to bump the epoch (nobody goes back to level 0)",
        "            self.epoch += 1\n            self.num_boosts += 1",
        "            self.num_boosts += 1",
    ),
    # FairPolicy.order_waiting / on_step
    (
        "fair: no provisional charge (a tenant's whole burst goes first)",
        "                heapq.heappush(heap, (c + self.input_weight * todo, i, t))",
        "                heapq.heappush(heap, (c, i, t))",
    ),
    (
        "fair: order_waiting charges the real counters",
        "                heapq.heappush(heap, (c + self.input_weight * todo, i, t))",
        "                self.counters[t] += self.input_weight * todo\n"
        "                heapq.heappush(heap, (c + self.input_weight * todo, i, t))",
    ),
    (
        "fair: ties between tenants by name, not by the oldest waiting request",
        "heap = [(self.counters[t], i, t) for i, t in enumerate(queues)]",
        "heap = [(self.counters[t], i, t) for i, t in enumerate(sorted(queues, key=str, reverse=True))]",
    ),
    (
        "fair: the most served tenant goes first",
        [
            (
                "heap = [(self.counters[t], i, t) for i, t in enumerate(queues)]",
                "heap = [(-self.counters[t], i, t) for i, t in enumerate(queues)]",
            ),
            (
                "heapq.heappush(heap, (c + self.input_weight * todo, i, t))",
                "heapq.heappush(heap, (c - self.input_weight * todo, i, t))",
            ),
        ],
    ),
    (
        "fair: on_step charges the prompt on every step, decode too",
        '            if s.phase == "prefill":\n                charge += self.input_weight * s.num_new_tokens',
        "            if True:\n                charge += self.input_weight * s.num_new_tokens",
    ),
    (
        "fair: on_step forgets the generated tokens",
        "charge = self.output_weight * self.new_output_tokens(r)",
        "charge = 0.0 * self.new_output_tokens(r)",
    ),
    (
        "fair: on_step counts output tokens at the input weight",
        "charge = self.output_weight * self.new_output_tokens(r)",
        "charge = self.input_weight * self.new_output_tokens(r)",
    ),
]
