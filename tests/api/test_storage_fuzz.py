"""Property-based tests of the stored responses on a full disk (hypothesis), against real SQLite.

- A state machine stores, continues, deletes and reads conversations of two tenants while the database
  fills up (`PRAGMA max_page_count` at its current size) and frees again, and restarts. The reference is a
  plain dict of what each acknowledged response is and of its conversation as the model sees it. After every
  step: every acknowledged response reads back whole with its conversation, none that failed or was refused
  exists, failures are only StorageFailure (while full) or QuotaExceeded (at the limit), and the connection
  is out of any transaction. At the end the store is opened again and everything is still there.
- What the store keeps of input items gives the model the same messages as the items sent
  (motet/api/responses/request.py `to_messages`, which builds the chat messages, is the reference).
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from motet.api.responses.items import model_visible
from motet.api.responses.request import to_messages
from motet.api.responses.store import QuotaExceeded, ResponseStore
from motet.api.sqlite_store import StorageFailure

MAX_PER_TENANT = 6
SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
blob = st.integers(0, 3_000).map(lambda n: "E" * n)  # what the model never sees: may be large
part = st.builds(
    lambda kind, t, extra: {"type": kind, "text": t, **extra},
    st.sampled_from(["input_text", "output_text"]),
    text,
    st.fixed_dictionaries({}, optional={"annotations": st.builds(lambda b: [{"url": b}], blob),
                                        "logprobs": st.builds(lambda b: [{"token": b}], blob)}),
)  # fmt: skip
content = st.one_of(text, st.lists(part, min_size=1, max_size=3))
message = st.builds(
    lambda role, c, extra: {"role": role, "content": c, **extra},
    st.sampled_from(["user", "assistant", "system", "developer"]),
    content,
    st.fixed_dictionaries(
        {}, optional={"type": st.just("message"), "id": text, "status": st.just("completed")}
    ),
)
call = st.builds(
    lambda cid, name, args: {"type": "function_call", "call_id": cid, "name": name, "arguments": args,
                             "id": "fc_1", "status": "completed"},
    text, text, text,
)  # fmt: skip
call_output = st.builds(
    lambda cid, out: {"type": "function_call_output", "call_id": cid, "output": out}, text, content
)
reasoning = st.builds(
    lambda b: {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": b,
               "content": [{"type": "reasoning_text", "text": b}]},
    blob,
)  # fmt: skip
items = st.lists(st.one_of(message, call, call_output, reasoning), max_size=4)


@settings(max_examples=200, **SETTINGS)
@given(items)
def test_what_is_stored_of_the_items_gives_the_model_the_same_messages(sent):
    assert to_messages(model_visible(sent)) == to_messages(sent)
    assert model_visible(model_visible(sent)) == model_visible(sent)  # stored twice: the same


class FillingDisk(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="motet-storage-fuzz-")
        self.store = ResponseStore(self.dir, max_per_tenant=MAX_PER_TENANT)
        self.full = False
        self.known: dict[str, tuple[str, dict, list]] = {}  # id -> (tenant, response, its conversation)
        self.gone: set[str] = set()  # ids refused, failed or deleted
        self.next_id = 0

    def teardown(self):
        self.store.close()
        if not self.gone & set(self.known):  # a restart keeps every acknowledged response
            self.store = ResponseStore(self.dir)
            self.check_everything()
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def ids(self, tenant: str) -> list[str]:
        return sorted(i for i, (t, _, _) in self.known.items() if t == tenant)

    @rule(tenant=st.sampled_from(["alice", "bob"]), sent=items, answer=blob, reasoning_text=blob,
          pick=st.integers(0, 10))  # fmt: skip
    def put(self, tenant, sent, answer, reasoning_text, pick):
        ids = self.ids(tenant)
        previous = ids[pick] if ids and pick < len(ids) else None  # sometimes a new conversation
        rid = f"resp_{self.next_id}"
        self.next_id += 1
        output = [{"id": "rs", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                   "text": reasoning_text}]},
                  {"id": "msg", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": answer, "annotations": [], "logprobs": []}]}]  # fmt: skip
        response = {"id": rid, "object": "response", "previous_response_id": previous, "output": output}
        history = self.known[previous][2] if previous else []
        at_limit = len(ids) >= MAX_PER_TENANT
        try:
            self.store.put(tenant, response, sent, previous, history)
        except QuotaExceeded:
            assert at_limit
            self.gone.add(rid)
            return
        except StorageFailure as e:
            assert self.full and e.full and not at_limit, e
            self.gone.add(rid)
            return
        assert not at_limit
        self.known[rid] = (tenant, response, [*history, *model_visible(sent), *model_visible(output)])

    @rule(pick=st.integers(0, 100))
    def delete(self, pick):
        if not self.known:
            return
        rid = sorted(self.known)[pick % len(self.known)]
        tenant = self.known[rid][0]
        assert not self.store.delete("carol", rid)  # another tenant's id is missing
        try:
            assert self.store.delete(tenant, rid)
        except StorageFailure:
            assert self.full
            return
        del self.known[rid]
        self.gone.add(rid)

    @precondition(lambda self: not self.full)
    @rule()
    def fill(self):
        db = self.store._db  # max_page_count holds per connection: the store's own
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        self.full = True

    @precondition(lambda self: self.full)
    @rule()
    def free(self):
        self.store._db.execute("PRAGMA max_page_count = 1073741823")
        self.full = False

    @rule()
    def restart(self):
        self.store.close()
        self.store = ResponseStore(self.dir, max_per_tenant=MAX_PER_TENANT)
        self.full = False

    @invariant()
    def check_everything(self):
        assert not self.store._db.in_transaction
        for rid, (tenant, response, conversation) in self.known.items():
            assert self.store.get(tenant, rid) == response
            assert self.store.conversation(tenant, rid).items == conversation
            assert self.store.get("carol", rid) is None
        for rid in self.gone:
            assert all(self.store.get(t, rid) is None for t in ("alice", "bob"))
        for tenant in ("alice", "bob"):
            assert self.store.usage(tenant)[0] == len(self.ids(tenant))


TestFillingDisk = FillingDisk.TestCase
TestFillingDisk.settings = settings(max_examples=30, stateful_step_count=30, **SETTINGS)
