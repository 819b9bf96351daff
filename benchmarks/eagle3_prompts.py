"""The prompts of train_eagle3 (issue 18): training questions over some topic families, held-out
prompts over others, so that a head which memorised the training topics or phrasings cannot pass.

Training questions come from two sources: templates filled with a topic, and requests the target
writes itself. For the latter it first proposes topics (`topic_seed`: a list of topics it
continues), then continues lists of requests of one kind each (`request_seed`: explanations,
lists, comparisons, advice, creative writing, code, math, editing text, as chat users ask), both
sampled at temperature 1, one item a line (`listed_items`). Held-out prompts belong to topic
families no training topic comes from, and use phrasings no template has; a topic or request the
target writes that mentions a held-out family's words is dropped (`mentions_held_out`), since
sampling wanders.
"""

from __future__ import annotations

import random
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
# Held-out topic families: the held-out prompts' own, and the word stems a training topic or
# question must not contain (matched at word starts, with plural and verb endings). The lists go
# beyond the held-out prompts' words, so that what the target writes stays out of those families.
HELD_OUT_FAMILIES: dict[str, tuple[str, ...]] = {
    "music": ("music", "musician", "musical", "song", "songwriter", "singer", "singing", "sing", "piano",
              "pianist", "guitar", "guitarist", "violin", "violinist", "cello", "flute", "trumpet",
              "saxophone", "harp", "drum", "drummer", "orchestra", "symphony", "symphonies", "choir",
              "composer", "concert", "jazz", "opera", "ballet", "melody", "melodies", "rhythm", "band",
              "album", "lyric", "chord", "tune", "instrument", "karaoke", "rapper", "hip hop", "playlist"),
    "food and cooking": ("food", "cook", "cooking", "cooker", "recipe", "meal", "dinner", "lunch",
                         "breakfast", "kitchen", "soup", "bread", "cheese", "chocolate", "coffee", "tea",
                         "fruit", "vegetable", "vegetarian", "vegan", "mango", "tomato", "tomatoes", "baking",
                         "bake", "baked", "baker", "bakery", "cake", "cookie", "pizza", "sushi", "rice",
                         "pasta", "noodle", "salad", "sandwich", "burger", "meat", "chicken", "beef", "pork",
                         "egg", "milk", "butter", "sugar", "flour", "apple", "banana", "potato", "potatoes",
                         "spice", "sauce", "ingredient", "flavor", "flavour", "delicious", "tasty", "tasted",
                         "eat", "eating", "eaten", "taste", "dessert", "snack", "chef", "restaurant",
                         "cuisine", "dish", "menu", "grocery", "groceries", "juice", "wine", "beer",
                         "smoothie", "candy", "oven", "microwave", "barbecue", "picnic", "diet", "nutrition",
                         "calorie", "hungry"),
    "pets and home": ("pet", "cat", "kitten", "kitty", "dog", "puppy", "puppies", "goldfish", "hamster",
                      "parrot", "aquarium", "leash", "vet", "veterinarian", "refrigerator", "fridge",
                      "garden", "gardening", "furniture", "living room", "bedroom", "bathroom", "sofa",
                      "couch", "cozy", "fireplace", "blanket", "laundry", "houseplant", "home", "house",
                      "household", "housework", "apartment", "chore", "dishwasher", "lawn", "backyard",
                      "decorating"),
    "work and careers": ("job", "career", "interview", "manager", "boss", "coworker", "colleague", "employee",
                         "employer", "employment", "unemployment", "worker", "workday", "workplace", "office",
                         "salary", "wage", "resume", "hire", "hired", "hiring", "intern", "internship",
                         "profession", "professional", "occupation", "business", "company", "companies",
                         "startup", "entrepreneur", "meeting", "deadline", "leader", "leadership",
                         "team leader", "lighthouse keeper", "day off", "promotion", "retirement",
                         "firefighter", "lawyer", "nurse", "farmer", "plumber", "electrician", "accountant"),
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


# Kinds of request chat users make, each a list the target continues: its heading, and the
# examples its first two items are drawn from ("{}": a topic; none: a request of its own).
REQUEST_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "explain": ("questions people ask an assistant to explain something",
                ("How does {} work?", "What causes {}?", "Can you explain {} in simple words?",
                 "What is the science behind {}?", "Why do people study {}?")),
    "list": ("requests for lists",
             ("List five interesting facts about {}.", "What are the main types of {}?",
              "Name some famous examples of {}.", "Give me a checklist for learning about {}.")),
    "compare": ("requests to compare things",
                ("Compare {} and {}.", "What is the difference between {} and {}?",
                 "Which is more useful, {} or {}?")),
    "advice": ("questions people ask for advice",
               ("How can I get better at public speaking?", "How can I learn more about {}?",
                "What is the best way to start with {}?", "How can I stay focused while studying?",
                "What mistakes should I avoid with {}?")),
    "creative": ("creative writing requests",
                 ("Write a short story about {}.", "Write a poem about {}.",
                  "Write a funny dialogue about {}.",
                  "Write a story for children about a robot who learns to paint.",
                  "Write the opening paragraph of a mystery novel.")),
    "code": ("programming tasks people give an assistant",
             ("Write a Python function that checks whether a number is prime.",
              "Show me how to read a file line by line in Python.",
              "Explain what a for loop does in JavaScript.",
              "Write a SQL query that counts the rows of a table.",
              "What is the difference between a list and a tuple in Python?",
              "Write a function that reverses a string.")),
    "math": ("math questions and word problems",
             ("A train travels 120 miles in 2 hours. What is its average speed?", "What is 15% of 240?",
              "Solve for x: 3x + 7 = 22.", "A rectangle is 8 cm long and 5 cm wide. What is its area?",
              "How many seconds are there in a day?")),
    "edit": ("requests to rewrite, summarize or translate a text",
             ("Rewrite this sentence in a formal tone: the test was super hard and everyone was mad.",
              "Summarize the main idea of {} in two sentences.",
              "Correct the grammar: she don't like going to the park on sundays.",
              "Translate 'where is the train station?' into French.",
              "Make this sentence shorter: due to the fact that it was raining, we stayed inside.")),
}


def topic_seed(examples: list[str]) -> str:
    """A plain-text list of topics the target continues (its next lines, sampled, are topics)."""
    items = "".join(f"{i}. {topic}\n" for i, topic in enumerate(examples, 1))
    return f"Here is a list of topics people ask an assistant about:\n{items}{len(examples) + 1}."


def request_seed(kind: str, rng: random.Random, topics: list[str]) -> str:
    """A plain-text list of requests of `kind` the target continues: two of its examples, their
    topic slots filled from `topics`; the next lines, sampled, are the target's requests."""
    heading, examples = REQUEST_KINDS[kind]
    first, second = (example.format(*rng.sample(topics, example.count("{}")))
                     for example in rng.sample(examples, 2))
    return f"Here are some {heading}:\n1. {first}\n2. {second}\n3."


_NUMBERED = re.compile(r"\s*(\d+)[.)]\s*(.*)")


def listed_items(continuation: str, complete: bool) -> list[str]:
    """The items the target wrote after a seed that ends with the next item's number: the rest of
    that line, then each following line numbered as the list goes on, up to the first that is
    not. The last line counts only if `complete` (the sample ended there, not at its token limit)."""
    lines = continuation.split("\n")
    if not complete:
        lines.pop()  # cut off mid-item
    items = lines[:1]
    for line in lines[1:]:
        numbered = _NUMBERED.fullmatch(line)
        if numbered is None:
            break
        items.append(numbered.group(2))
    return [item.strip() for item in items]


def proposed_topic(item: str) -> str | None:
    """A topic the target proposed, or None: not one to several plain words, or of a held-out family."""
    topic = item.strip().rstrip(".")
    if not re.fullmatch(r"[A-Za-z][A-Za-z' -]{2,40}", topic) or len(topic.split()) > 5:
        return None
    return None if mentions_held_out(topic) else topic


def written_question(line: str) -> str | None:
    """A request the target wrote, or None: too short or too long, or about a held-out family."""
    question = line.strip()
    if not 3 <= len(question.split()) <= 60 or mentions_held_out(question):
        return None
    return question
