"""Answer parser: every failure mode of the taxonomy and adversarial text."""

import json

import pytest

from dgr2_jax.task import answer

C = [f"<a_{k}><b_{k + 1}><c_{2 * k}><d_0>" for k in range(10)]  # retriever order
THINK = "<think>The user likes nails; " + " ".join(C[:4]) + " look related.</think>"


def js(r):
  return json.dumps({"ranking": r})


def parse(text, **kw):
  return answer.parse_response(text, C, **kw)


def test_valid_roundtrip_and_positions():
  order = [3, 0, 1, 2, 4, 5, 6, 7, 8, 9]
  text = answer.format_response("because", [C[k] for k in order])
  assert text.startswith("<think>because</think>{")
  p = parse(text + "<|im_end|>")
  assert p.verdict == answer.VALID and p.valid
  assert p.positions == tuple(order)
  assert p.reasoning == "because"


@pytest.mark.parametrize("text", [
    THINK + "Here is my ranking: " + js(C[::-1]) + " Hope this helps!",  # prose around
    THINK + "\n\n```json\n" + js(C[::-1]) + "\n```",                     # code fence
    THINK + "{note} then " + js(C[::-1]),                                # non-JSON brace first
    THINK + js(C[::-1]) + '{"ranking": []}',                             # first ranking wins
    THINK + js(C[::-1]) + "<|im_end|>garbage {",                         # text after EOS cut
    "<think>decoy " + js(C) + "</think>" + js(C[::-1]),                   # JSON in reasoning
])
def test_adversarial_but_valid(text):
  p = parse(text)
  assert p.verdict == answer.VALID, text
  assert p.positions == tuple(range(9, -1, -1))


def test_sids_with_whitespace_and_unicode_normalised():
  spaced = [s.replace("><", "> \n<") for s in C]
  assert parse(THINK + js(spaced)).verdict == answer.VALID
  zero_width = [s.replace("><", ">\u200b<") for s in C]
  assert parse(THINK + js(zero_width)).verdict == answer.VALID
  fullwidth = [s.replace("<", "\uff1c").replace(">", "\uff1e").replace("_", "\uff3f") for s in C]
  assert parse(THINK + json.dumps({"ranking": fullwidth}, ensure_ascii=False)).valid
  # Unicode prose in the reasoning does not matter.
  assert parse("<think>Ünïcödé ✓ 日本語</think>" + js(C)).valid


def test_missing_think_close_is_unparseable():
  p = parse("<think>reasoning never closed " + js(C))
  assert p.verdict == answer.UNPARSEABLE
  assert p.positions == tuple(range(10))  # fallback = retriever order
  assert parse(js(C), require_think=False).valid


@pytest.mark.parametrize("tail", [
    '{"ranking": ["' + C[0] + '", "' + C[1][:5],   # truncated JSON
    '{"rank": ' + json.dumps(C) + "}",             # wrong key
    '{"ranking": "' + C[0] + '"}',                 # not a list
    '{"ranking": [1, "' + C[0] + '"]}',              # mixed numbers and SIDs
    '{"ranking": [true, false]}',                  # booleans are not numbers
    '{"ranking": [1.0, 2.0]}',                     # nor are floats
    "I cannot rank these.",                        # no JSON at all
    "",
])
def test_unparseable(tail):
  p = parse(THINK + tail)
  assert p.verdict == answer.UNPARSEABLE
  assert p.ranking == ()


def test_duplicate():
  r = C[:9] + [C[0]]
  p = parse(THINK + js(r))
  assert p.verdict == answer.DUPLICATE
  assert p.flags == {answer.DUPLICATE, answer.OMISSION}  # C[9] is missing too
  assert p.positions == tuple(range(10))
  # 11 in-set entries: a duplicate, no omission.
  p = parse(THINK + js(C + [C[3]]))
  assert p.verdict == answer.DUPLICATE and p.flags == {answer.DUPLICATE}


def test_omission():
  p = parse(THINK + js(C[:9]))
  assert p.verdict == answer.OMISSION and p.flags == {answer.OMISSION}
  assert parse(THINK + js([])).verdict == answer.OMISSION


def test_out_of_set():
  outside = "<a_99><b_99><c_99><d_0>"
  p = parse(THINK + js(C[:9] + [outside]))
  assert p.verdict == answer.OUT_OF_SET
  assert p.flags == {answer.OUT_OF_SET, answer.OMISSION}
  assert parse(THINK + js(C[:9] + ["\U0001F600"])).verdict == answer.OUT_OF_SET
  assert parse(THINK + js(C[:9] + [C[9][:-6]])).verdict == answer.OUT_OF_SET  # partial SID
  # Precedence: out-of-set beats duplicate.
  p = parse(THINK + js(C[:8] + [C[0], outside]))
  assert p.verdict == answer.OUT_OF_SET
  assert p.flags == {answer.OUT_OF_SET, answer.DUPLICATE, answer.OMISSION}


def test_duplicate_candidates_are_a_caller_error():
  with pytest.raises(ValueError, match="not unique"):
    answer.parse_response(THINK + js(C), C[:9] + [C[0]])


def test_candidate_numbers():
  """`answer_ids='number'`: 1-based `#k` numbers map to the candidates' SIDs; same taxonomy."""
  order = [3, 0, 1, 2, 4, 5, 6, 7, 8, 9]
  nums = answer.ranking_entries(order, C, "number")
  assert nums == [4, 1, 2, 3, 5, 6, 7, 8, 9, 10]
  assert answer.ranking_entries(order, C, "sid") == [C[k] for k in order]
  text = answer.format_response("because", nums)
  assert text.endswith('{"ranking": [4, 1, 2, 3, 5, 6, 7, 8, 9, 10]}')
  p = parse(text)
  assert p.valid and p.positions == tuple(order) and p.ranking == tuple(C[k] for k in order)
  p = parse(THINK + js(list(range(1, 10)) + [11]))
  assert p.verdict == answer.OUT_OF_SET and p.ranking[-1] == "#11"
  assert parse(THINK + js([0] + list(range(2, 11)))).verdict == answer.OUT_OF_SET
  p = parse(THINK + js([1] + list(range(1, 10))))
  assert p.verdict == answer.DUPLICATE and p.flags == {answer.DUPLICATE, answer.OMISSION}
  assert parse(THINK + js(list(range(1, 10)))).verdict == answer.OMISSION
  with pytest.raises(ValueError, match="answer_ids"):
    answer.ranking_entries(order, C, "index")
