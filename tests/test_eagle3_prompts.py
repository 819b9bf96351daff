"""train_eagle3's held-out split (benchmarks/eagle3_prompts.py, issue 18): the held-out prompts
must differ from the training questions in topic and in phrasing, so that a head which memorised
the training topics or templates cannot pass them; and the filter on the questions the target
writes must drop those that wander into a held-out family."""

from __future__ import annotations

import importlib.util
import itertools
import random
import re
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def prompts() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "eagle3_prompts.py"
    spec = importlib.util.spec_from_file_location("eagle3_prompts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def topic_stem(topic: str) -> str:
    """A topic without its article and plural ending: 'the Pyramids of Giza' -> 'pyramids of giza',
    'lighthouses' -> 'lighthouse' (matched at a word's start, so plurals and longer words match)."""
    stem = re.sub(r"^the ", "", topic.lower())
    return stem[:-1] if stem.endswith("s") and " " not in stem else stem


def test_no_held_out_prompt_names_a_training_topic(prompts: ModuleType) -> None:
    assert not set(prompts.TOPIC_FAMILIES) & set(prompts.HELD_OUT_FAMILIES)
    shared = [(prompt, topic) for prompt in prompts.HELD_OUT for topic in prompts.TOPICS
              if re.search(r"\b" + re.escape(topic_stem(topic)), prompt.lower())]
    assert not shared


def assert_no_held_out_prompt_fits(prompts: ModuleType, template: str) -> None:
    """No held-out prompt fits `template` (any text in its slots) or opens with its first three words."""
    fits = re.compile(re.escape(template).replace(re.escape("{}"), ".+") + ".*", re.IGNORECASE)
    opening = " ".join(template.lower().split()[:3])
    for prompt in prompts.HELD_OUT:
        assert not fits.fullmatch(prompt), (template, prompt)
        assert " ".join(prompt.lower().split()[:3]) != opening, (template, prompt)


def test_held_out_prompts_use_no_template_phrasing(prompts: ModuleType) -> None:
    """No held-out prompt fits a template (any topic in its slot) or opens with a template's
    first three words."""
    for template in prompts.TEMPLATES:
        assert_no_held_out_prompt_fits(prompts, template)


def test_the_filter_tells_held_out_families_from_training_topics(prompts: ModuleType, rng_seed: int) -> None:
    """Every held-out prompt is one the filter would drop; no templated training question is;
    and a training question with a held-out family's word put in is dropped."""
    print(f"seed {rng_seed}")
    assert all(prompts.mentions_held_out(prompt) for prompt in prompts.HELD_OUT)
    training = prompts.template_questions(len(prompts.TOPICS) * len(prompts.TEMPLATES) * len(prompts.STYLES))
    assert len(set(training)) == len(training)
    assert not [q for q in training if prompts.mentions_held_out(q)]
    rng = random.Random(rng_seed)
    words = [word for family in prompts.HELD_OUT_FAMILIES.values() for word in family]
    for question in rng.sample(training, 50):
        word = rng.choice(words)
        mixed = question.rstrip("?.") + f" and {word}s?"
        assert prompts.written_question(mixed) is None, mixed
        assert prompts.written_question(question) == question


def test_held_out_prompts_fit_no_request_example(prompts: ModuleType) -> None:
    """The examples the target's request lists start from are templates too: none fits a
    held-out prompt or opens like one, and none names a held-out family."""
    for _, examples in prompts.REQUEST_KINDS.values():
        for example in examples:
            assert not prompts.mentions_held_out(example), example
            assert_no_held_out_prompt_fits(prompts, example)


def test_seeds_are_lists_over_training_topics(prompts: ModuleType, rng_seed: int) -> None:
    """A request seed is a numbered list of two of its kind's examples, their slots filled with
    the given topics, ending where the target writes item 3; a topic seed lists its topics."""
    print(f"seed {rng_seed}")
    rng = random.Random(rng_seed)
    topics = rng.sample(prompts.TOPICS, 12)
    for kind, (heading, examples) in prompts.REQUEST_KINDS.items():
        seed = prompts.request_seed(kind, rng, topics)
        assert not prompts.mentions_held_out(seed)
        first_line, one, two, three = seed.split("\n")
        assert first_line == f"Here are some {heading}:" and three == "3."
        for line, number in ((one, "1. "), (two, "2. ")):
            assert line.startswith(number)
            # one of the examples with its slots filled by given topics (compared whole: a topic may
            # hold a slot's own words, "acids and bases" in "Compare {} and {}.")
            assert any(line[3:] == e.format(*chosen) for e in examples
                       for chosen in itertools.permutations(topics, e.count("{}"))), line
    listed = rng.sample(prompts.TOPICS, 3)
    seed = prompts.topic_seed(listed)
    assert seed.endswith(f"1. {listed[0]}\n2. {listed[1]}\n3. {listed[2]}\n4.")


def test_listed_items_reads_the_lines_that_continue_the_list(prompts: ModuleType) -> None:
    continuation = " How do clouds form?\n4. What is a volcano?\n5) Why is the sky blue?\n\nThese questions"
    assert prompts.listed_items(continuation, complete=True) == [
        "How do clouds form?", "What is a volcano?", "Why is the sky blue?"]
    # cut at the token limit: the last line is dropped, however it looks
    cut = " How do clouds form?\n4. What is a vol"
    assert prompts.listed_items(cut, complete=False) == ["How do clouds form?"]
    assert prompts.listed_items(" How do clouds form?\n4. What is a volcano?", complete=True) == [
        "How do clouds form?", "What is a volcano?"]
    assert prompts.listed_items(" How do clouds", complete=False) == []


def test_target_written_topics_and_requests_stay_out_of_held_out_families(prompts: ModuleType) -> None:
    """Topics and requests a sampled list may hold: those of a held-out family (beyond the
    held-out prompts' own words) are dropped, others kept."""
    for topic in ("baking bread", "Cats", "guitar lessons", "job interviews", "home decorating", "hip hop",
                  "Breakfast ideas", "team leadership"):
        assert prompts.proposed_topic(topic) is None, topic
    for topic in ("the solar system", "Ancient Rome", "quantum computing", "first aid"):
        assert prompts.proposed_topic(topic + ".") == topic
    for item in ("A very long topic with far too many words in it", "42", "C++ & Rust", ""):
        assert prompts.proposed_topic(item) is None, item
    for request in ("How do I bake a birthday cake?", "What should I feed my new puppy?",
                    "Write a song about the sea.", "How do I ask my boss for a raise?",
                    "Tips for cleaning the house quickly?", "Which restaurant serves the best pasta?"):
        assert prompts.written_question(request) is None, request
    for request in ("Write a Python function that sorts a list.", "What is 12% of 250?",
                    "Explain how rainbows form."):
        assert prompts.written_question(request) == request
    assert prompts.written_question("  Why?") is None  # too short to be a question
