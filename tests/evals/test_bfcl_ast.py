"""BFCL's AST check (motet/evals/bfcl_ast.py) on hand-made cases, and on the dev set's own ground truth."""

from __future__ import annotations

from motet.evals.bfcl_ast import Call, check, standardize
from tests.dev_sets import dev_set, read_jsonl

FN = {
    "name": "book",
    "parameters": {
        "type": "dict",
        "properties": {
            "city": {"type": "string"},
            "nights": {"type": "integer"},
            "budget": {"type": "float"},
            "pets": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "prefs": {
                "type": "dict",
                "properties": {"size": {"type": "string"}, "floor": {"type": "integer"}},
            },
            "rooms": {"type": "array", "items": {"type": "dict"}},
            "note": {"type": "any"},
        },
        "required": ["city", "nights"],
    },
}
GT = [
    {
        "book": {
            "city": ["New York", "NYC"],
            "nights": [3],
            "budget": [150.0, ""],
            "pets": [False, ""],
            "tags": [["quiet", "sea view"], ""],
            "prefs": [{"size": ["king"], "floor": [2, ""]}, ""],
            "rooms": [[{"kind": ["double"]}, {"kind": ["single"]}], ""],
            "note": ["late check-in", ""],
        }
    }
]


def one(**args) -> str | None:
    return check([Call("book", args)], GT, [FN])


def test_a_minimal_correct_call():
    assert one(city="New York", nights=3) is None


def test_name_required_unknown_and_missing_parameters():
    assert "wrong function" in check([Call("rent", {"city": "NYC", "nights": 3})], GT, [FN])
    assert "missing required" in one(city="NYC")
    assert "unexpected parameter" in one(city="NYC", nights=3, stars=5)
    gt = [{"book": {"city": ["NYC"], "nights": [3], "budget": [150.0]}}]  # budget not optional here
    assert "missing parameter 'budget'" in check([Call("book", {"city": "NYC", "nights": 3})], gt, [FN])


def test_strings_are_standardized_like_bfcl():
    assert standardize("New York, N.Y.") == "newyorkny"
    assert standardize("it's") == 'it"s'
    assert one(city="new york", nights=3) is None
    assert one(city="New-York", nights=3) is None
    assert one(city="N Y C", nights=3) is None
    assert one(city="Boston", nights=3) is not None


def test_number_and_boolean_types():
    assert one(city="NYC", nights=3, budget=150) is None  # an int is fine for a float
    assert one(city="NYC", nights=3, budget=150.0) is None
    assert "float where integer" in one(city="NYC", nights=3.0)
    assert one(city="NYC", nights=3, pets=False) is None
    assert one(city="NYC", nights=3, pets=0) is not None  # 0 is not false
    assert "where integer" in one(city="NYC", nights=True)


def test_lists_compare_in_order_with_standardized_strings():
    assert one(city="NYC", nights=3, tags=["Quiet", "Sea-View"]) is None
    assert one(city="NYC", nights=3, tags=["sea view", "quiet"]) is not None
    assert one(city="NYC", nights=3, tags=["quiet"]) is not None
    assert one(city="NYC", nights=3, tags="quiet") is not None


def test_dict_parameters_and_lists_of_dicts():
    assert one(city="NYC", nights=3, prefs={"size": "King"}) is None  # floor may be omitted
    assert one(city="NYC", nights=3, prefs={"size": "king", "floor": 2}) is None
    assert one(city="NYC", nights=3, prefs={"size": "king", "floor": 3}) is not None
    assert one(city="NYC", nights=3, prefs={"floor": 2}) is not None  # size is not optional
    assert one(city="NYC", nights=3, prefs={"size": "king", "view": "sea"}) is not None
    assert one(city="NYC", nights=3, rooms=[{"kind": "double"}, {"kind": "single"}]) is None
    assert one(city="NYC", nights=3, rooms=[{"kind": "single"}, {"kind": "double"}]) is not None


def test_nested_literal_dicts_compare_recursively():
    fn = {
        "name": "drive",
        "parameters": {
            "type": "dict",
            "properties": {"ego": {"type": "dict", "properties": {"position": {"type": "dict"}}}},
            "required": ["ego"],
        },
    }
    gt = [{"drive": {"ego": [{"position": [{"lateral": 10.5, "longitudinal": 50}], "heading": [30]}]}}]
    good = {"ego": {"position": {"lateral": 10.5, "longitudinal": 50.0}, "heading": 30}}
    assert check([Call("drive", good)], gt, [fn]) is None
    bad = {"ego": {"position": {"lateral": 10.5}, "heading": 30}}
    assert check([Call("drive", bad)], gt, [fn]) is not None


def test_any_is_not_type_checked_and_a_variable_passes_by_value():
    assert one(city="NYC", nights=3, note="Late check-in") is None
    fn = {
        "name": "f",
        "parameters": {"type": "dict", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    }
    gt = [{"f": {"n": ["count"]}}]  # BFCL's "variable": the answer names a variable where an int is declared
    assert check([Call("f", {"n": "count"})], gt, [fn]) is None
    assert check([Call("f", {"n": "other"})], gt, [fn]) is not None


def test_arguments_that_are_not_an_object():
    assert "not a JSON object" in check([Call("book", None)], GT, [FN])


def test_parallel_calls_match_in_any_order_one_to_one():
    fn = {
        "name": "play",
        "parameters": {
            "type": "dict",
            "properties": {"artist": {"type": "string"}, "minutes": {"type": "integer"}},
        },
    }
    gt = [
        {"play": {"artist": ["Taylor Swift"], "minutes": [20]}},
        {"play": {"artist": ["Maroon 5"], "minutes": [15]}},
    ]
    a, b = (
        Call("play", {"artist": "Taylor Swift", "minutes": 20}),
        Call("play", {"artist": "Maroon 5", "minutes": 15}),
    )
    assert check([a, b], gt, [fn]) is None
    assert check([b, a], gt, [fn]) is None
    assert "expected 2 call(s), got 1" in check([a], gt, [fn])
    assert "no call matches" in check([a, a], gt, [fn])  # one call cannot serve two expected calls


def test_parallel_matching_is_a_full_matching_not_greedy():
    fn = {"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "integer"}}}}
    gt = [{"f": {"x": [1, 2]}}, {"f": {"x": [1]}}]
    # Greedy would give the first expected call the first call (x=1) and leave nothing for the second.
    assert check([Call("f", {"x": 1}), Call("f", {"x": 2})], gt, [fn]) is None


def test_irrelevance_is_right_only_without_calls():
    assert check([], None, [FN]) is None
    assert "expected no call" in check([Call("book", {"city": "NYC", "nights": 3})], None, [FN])


DEV, DEV_IS_FULL = dev_set("bfcl")


def test_every_consistent_dev_case_accepts_its_own_ground_truth():
    """Calls built from each case's first allowed values (in shuffled order) must pass; cases whose ground
    truth contradicts its schema (a required parameter left optional, a parameter the schema lacks) are
    unwinnable in BFCL too and are left out."""
    import random

    def first(allowed: list):
        return next((v for v in allowed if v != ""), None)

    def concrete(a):  # an answer pattern -> a value it allows
        if isinstance(a, dict):
            return {k: concrete(first(v)) if isinstance(v, list) else v for k, v in a.items() if v != [""]}
        return [concrete(x) for x in a] if isinstance(a, list) else a

    rng = random.Random(0)
    checked = 0
    for case in read_jsonl(DEV):
        specs = {f["name"]: f["parameters"] for f in case["function"]}
        calls, consistent = [], True
        for expected in case["ground_truth"] or []:
            ((name, answer),) = expected.items()
            args = {
                p: concrete(first(allowed)) for p, allowed in answer.items() if first(allowed) is not None
            }
            known, required = set(specs[name].get("properties", {})), set(specs[name].get("required", []))
            consistent &= set(answer) <= known and required <= set(args)
            calls.append(Call(name, args))
        if not consistent:
            continue
        rng.shuffle(calls)
        assert check(calls, case["ground_truth"], case["function"]) is None, case["id"]
        checked += 1
    assert checked > (1000 if DEV_IS_FULL else 100)
