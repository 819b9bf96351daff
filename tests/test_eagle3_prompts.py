"""train_eagle3's held-out split (benchmarks/eagle3_prompts.py, issue 18): the held-out prompts
must differ from the training questions in topic and in phrasing, so that a head which memorised
the training topics or templates cannot pass them; and the filter on the questions the target
writes must drop those that wander into a held-out family."""

from __future__ import annotations

import importlib.util
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


def test_held_out_prompts_use_no_template_phrasing(prompts: ModuleType) -> None:
    """No held-out prompt fits a template (any topic in its slot) or opens with a template's
    first three words."""
    for template in prompts.TEMPLATES:
        fits = re.compile(re.escape(template).replace(re.escape("{}"), ".+") + ".*", re.IGNORECASE)
        opening = " ".join(template.lower().split()[:3])
        for prompt in prompts.HELD_OUT:
            assert not fits.fullmatch(prompt), (template, prompt)
            assert " ".join(prompt.lower().split()[:3]) != opening, (template, prompt)


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


def test_question_seeds_open_a_list_about_training_topics(prompts: ModuleType) -> None:
    for topic in prompts.TOPICS:
        seed = prompts.question_seed(topic, 3)
        assert seed.startswith(f"Here are some questions about {topic}:\n1. ") and seed.endswith("\n2.")
        assert not prompts.mentions_held_out(seed)
    assert prompts.written_question("  Why?") is None  # too short to be a question
