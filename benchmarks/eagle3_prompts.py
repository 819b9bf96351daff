"""The prompts of train_eagle3 (issue 18): training questions over some topic families, held-out
prompts over others, so that a head which memorised the training topics or phrasings cannot pass.

Training questions come from two sources: templates filled with a topic, and questions the target
writes itself (`question_seed`: a list it continues, sampled at temperature 1, one line a question).
Held-out prompts belong to topic families no training topic comes from, and use phrasings no
template has; a question the target writes that mentions a held-out family's words is dropped
(`mentions_held_out`), since sampling may wander from the seed's topic.
"""

from __future__ import annotations

import re

# Training topics, by family (none of them is in a held-out family).
TOPIC_FAMILIES: dict[str, tuple[str, ...]] = {
    "earth": ("volcanoes", "earthquakes", "glaciers", "the water cycle", "the ocean tides", "deserts",
              "rivers", "coral reefs", "caves", "islands", "soil", "the Sahara", "the Arctic", "Antarctica",
              "mountains", "lakes", "beaches", "fossils", "minerals", "the Grand Canyon"),
    "weather": ("hurricanes", "tornadoes", "snow", "lightning", "rainbows", "climate change",
                "the ozone layer", "clouds", "fog", "droughts", "floods", "the seasons",
                "weather forecasts", "wind"),
    "space": ("black holes", "the moon landing", "comets", "the Big Bang", "telescopes", "satellites",
              "rockets", "the International Space Station", "Mars", "the Sun", "asteroids", "galaxies",
              "eclipses", "the Moon", "astronauts", "Jupiter"),
    "physics and chemistry": ("gravity", "electricity", "magnetism", "atoms", "the speed of light",
                              "friction", "sound waves", "lasers", "batteries", "the periodic table",
                              "nuclear power", "heat", "acids and bases", "static electricity", "plastics",
                              "metals"),
    "life science": ("photosynthesis", "DNA", "evolution", "the human heart", "the immune system",
                     "vaccines", "antibiotics", "sleep", "dreams", "memory", "the brain", "bones", "cells",
                     "bacteria", "mushrooms", "trees", "flowers", "the lungs", "viruses", "genetics"),
    "wild animals": ("honey bees", "wolves", "octopuses", "penguins", "elephants", "sharks", "butterflies",
                     "ants", "owls", "dolphins", "whales", "tigers", "frogs", "spiders", "camels",
                     "kangaroos", "eagles", "snakes", "dinosaurs", "bats", "polar bears", "jellyfish",
                     "crocodiles"),
    "history": ("the French Revolution", "the Roman Empire", "the Renaissance", "the Pyramids of Giza",
                "the Great Wall of China", "the Silk Road", "the Industrial Revolution",
                "the printing press", "the steam engine", "the Vikings", "ancient Egypt", "ancient Greece",
                "the Aztecs", "the Cold War", "World War I", "the Middle Ages", "the samurai",
                "the Ottoman Empire", "the American Revolution", "the Eiffel Tower", "castles", "knights",
                "the Wright brothers"),
    "technology": ("the internet", "machine learning", "smartphones", "computers", "3D printing",
                   "social media", "email", "video games", "virtual reality", "cloud computing",
                   "cybersecurity", "passwords", "open-source software", "databases", "programming",
                   "radio", "television", "microscopes", "electric cars", "solar panels", "wind energy",
                   "hydropower", "robots", "GPS"),
    "economy": ("the stock market", "cryptocurrency", "saving money", "taxes", "banking", "inflation",
                "international trade", "advertising", "money", "credit cards", "insurance",
                "shopping online"),
    "sports": ("chess", "football", "the Olympic Games", "marathons", "tennis", "basketball", "skiing",
               "swimming", "running", "yoga", "cycling", "baseball", "golf", "rock climbing",
               "table tennis"),
    "arts": ("painting", "photography", "sculpture", "poetry", "theater", "film making", "comic books",
             "origami", "knitting", "pottery", "architecture", "calligraphy", "novels", "fairy tales"),
    "society": ("democracy", "public libraries", "museums", "schools", "the postal service", "friendship",
                "kindness", "homework", "exams", "public speaking", "habits", "happiness", "stress",
                "meditation", "exercise", "drinking water", "hand washing", "elections", "languages",
                "volunteering", "birthdays", "holidays"),
    "environment": ("recycling", "plastic waste", "air pollution", "forests", "wetlands", "composting",
                    "national parks", "endangered species", "renewable energy", "bees and flowers"),
    "transport and measure": ("trains", "ships", "bicycles", "submarines", "bridges", "skyscrapers", "maps",
                              "compasses", "clocks", "calendars", "time zones", "airports", "highways",
                              "the metric system"),
}
# Held-out topic families: the held-out prompts' own, and the word stems a training question
# must not contain (matched at word starts, with plural and verb endings).
HELD_OUT_FAMILIES: dict[str, tuple[str, ...]] = {
    "music": ("music", "musician", "song", "singer", "singing", "piano", "guitar", "violin", "drum",
              "drummer", "orchestra", "concert", "jazz", "opera", "ballet", "melody", "melodies", "rhythm",
              "band"),
    "food and cooking": ("food", "cook", "cooking", "recipe", "meal", "dinner", "lunch", "breakfast",
                         "kitchen", "soup", "bread", "cheese", "chocolate", "coffee", "tea", "fruit",
                         "vegetable", "vegetarian", "mango", "tomato", "baking", "pizza", "sushi", "rice",
                         "spice", "eat", "eating", "taste", "dessert", "snack"),
    "pets and home": ("pet", "cat", "kitten", "dog", "puppy", "puppies", "goldfish", "hamster", "parrot",
                      "refrigerator", "fridge", "garden", "gardening", "furniture", "living room", "cozy",
                      "laundry", "houseplant"),
    "work and careers": ("job", "career", "interview", "manager", "boss", "coworker", "colleague",
                         "employee", "office", "salary", "resume", "team leader", "lighthouse keeper",
                         "day off", "workplace", "promotion"),
}
# Held-out prompts: each from a held-out family, in phrasings no template has.
HELD_OUT = (
    "How does a violin make its sound?", "Write a limerick about a drummer who lost his sticks.",
    "What makes a song catchy?", "Give me tips for learning to play the guitar as an adult.",
    "Write a recipe for a simple tomato soup.", "Describe the taste of a ripe mango.",
    "How is baking soda different from baking powder?", "Plan a vegetarian dinner for four friends.",
    "Why do cats purr?", "How should I care for a goldfish?", "How does a refrigerator keep food cold?",
    "Describe a cozy living room on a winter evening.",
    "Describe a day in the life of a lighthouse keeper.", "What makes a good team leader?",
    "How do I prepare for a job interview?", "Write a polite note asking my manager for a day off.",
)
TEMPLATES = (
    "Explain {} to a ten-year-old.", "Write a short paragraph about {}.", "What are three facts about {}?",
    "Give me a brief history of {}.", "Why is {} important?", "Write a short poem about {}.",
    "List the pros and cons of {}.", "Describe {} in simple terms.", "What should a beginner know about {}?",
    "Summarize what scientists know about {}.", "Write a haiku about {}.",
    "Tell me a fun story involving {}.",
    "How would you teach a class about {}?", "What are common misconceptions about {}?",
    "Compare {} with something from everyday life.", "Write a short news report about {}.",
    "What questions do people often ask about {}?", "Give five keywords related to {} and explain each.",
    "Write a dialogue between two friends discussing {}.", "What is the future of {}?",
)
STYLES = ("", " Keep it short.", " Answer in detail.", " Use a list.")
TOPICS = tuple(topic for family in TOPIC_FAMILIES.values() for topic in family)

_HELD_OUT_WORDS = re.compile(
    r"\b(?:" + "|".join(re.escape(stem) for family in HELD_OUT_FAMILIES.values() for stem in family)
    + r")(?:s|es|ed|ing)?\b", re.IGNORECASE)


def mentions_held_out(text: str) -> bool:
    """Whether `text` names something of a held-out family (a word from its list)."""
    return _HELD_OUT_WORDS.search(text) is not None


def template_questions(count: int) -> list[str]:
    """Every (topic, template, style), interleaved so that a prefix covers many topics and templates."""
    n, m = len(TOPICS), len(TEMPLATES)
    # round j gives topic s template (s + j) mod m: each topic meets every template
    questions = [TEMPLATES[(i % n + i // n) % m].format(TOPICS[i % n]) + style
                 for style in STYLES for i in range(n * m)]
    return questions[:count]


def question_seed(topic: str, example: int) -> str:
    """A plain-text list the target continues with one more question about `topic` (its first
    item: template `example` on the topic): the next line, sampled, is the target's question."""
    first = TEMPLATES[example % len(TEMPLATES)].format(topic)
    return f"Here are some questions about {topic}:\n1. {first}\n2."


def written_question(line: str) -> str | None:
    """The question in a line the target wrote after a seed, or None: too short, or about a
    held-out family."""
    question = line.strip()
    if len(question.split()) < 3 or mentions_held_out(question):
        return None
    return question
