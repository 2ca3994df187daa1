"""Realistic benchmark prompts: short English passages built into the package.

Random token ids make a model repeat itself, which anything that guesses the next tokens
from earlier ones (prompt lookup, a small model) then gets right every time: a fair bench
needs text. The passages are plain prose on unrelated everyday topics, written for this
file (no dataset is needed), tokenized with the artifact's own tokenizer.
"""

from __future__ import annotations

from llmopt.runtime.tokenizer import Tokenizer

PASSAGES = (
    "The kettle clicked off just as the rain started again. Maria poured the water over the "
    "tea leaves, set a timer for four minutes, and went back to the letter she had been "
    "trying to finish since breakfast. It was to her brother, who had moved to a small town "
    "on the coast and wrote long, cheerful messages about the fishing boats.",
    "To repot a houseplant, water it the day before so the roots slide out easily. Choose a "
    "pot one size larger with a drainage hole, add a layer of fresh soil, and set the plant "
    "at the same depth it grew before. Fill the gaps, press gently, and water until it runs "
    "from the bottom.",
    "Our quarterly review found that most support tickets came from two sources: password "
    "resets and confusion about the new billing page. We propose a self-service reset link "
    "on the login screen and a short guide that explains each line of the invoice, which "
    "should cut the volume by about a third.",
    "The old railway bridge was built in 1887 from iron shipped up the river on barges. For "
    "decades it carried coal trains to the mills; after the line closed, the town turned it "
    "into a footpath, and on summer evenings it is crowded with people watching the sunset "
    "over the water.",
    "Why does bread go stale? Not mainly because it dries out, but because the starch inside "
    "slowly recrystallizes after baking, which makes the crumb firm and crumbly. Warming a "
    "stale loaf in the oven reverses part of the process for a while, which is why toast "
    "tastes fresher than the bread it came from.",
    "Dear team, the office will be closed on Friday for the electrical inspection. Please "
    "take your laptops home on Thursday evening and make sure your desks are clear, since "
    "the inspectors need access to the floor sockets. Meetings scheduled for Friday can move "
    "online or to the following week.",
    "A good running plan for beginners alternates short runs with walking. In the first "
    "week, run for one minute and walk for two, eight times, three days a week. Each week, "
    "add a minute of running and remove some walking, and after two months most people can "
    "run for half an hour without stopping.",
    "The museum's new exhibition follows the history of maps, from clay tablets and hand "
    "drawn sea charts to satellite images. Visitors can compare how different centuries "
    "pictured the same coastline, and a large table in the last room lets children build "
    "their own map of the neighbourhood from wooden blocks.",
    "When the power went out, the village did what it always did: someone lit candles in the "
    "hall, the baker brought the bread he could no longer sell, and a neighbour with a "
    "guitar started playing. By the time the lights came back, nobody was in a hurry to go "
    "home.",
    "To make a simple tomato sauce, warm olive oil in a pan, add sliced garlic, and cook it "
    "gently until it smells sweet. Pour in a tin of crushed tomatoes, a pinch of salt and a "
    "few basil leaves, then let it simmer for twenty minutes, stirring now and then, until "
    "it thickens.",
    "The committee met on Tuesday to discuss the library's opening hours. Several members "
    "argued for later evenings during the exam season, while others worried about staff "
    "costs. In the end they agreed to a trial: the library will stay open until ten for "
    "six weeks, and the numbers will decide.",
    "Astronomers measure the distance to nearby stars by watching them shift against the "
    "background as the Earth moves around the Sun. The smaller the shift, the farther the "
    "star. For distant galaxies this no longer works, and they rely instead on objects of "
    "known brightness, such as certain exploding stars.",
)


# What a user asks about the passages (chat prompts), one per prompt in turn.
REQUESTS = (
    "Summarize the text above in two sentences.",
    "What is the main point of the text above, and who would find it useful?",
    "Rewrite the first paragraph above in simpler words for a ten-year-old.",
    "Write three questions a reader might ask after reading the text above.",
)
_SLOT = "\x00content\x00"  # where the user's message sits in the rendered template


def text_prompts(tokenizer: Tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_len` tokens.

    With a chat template (an instruct model), each is a chat request: passages cut to fit,
    a question about them, then the assistant's turn; otherwise plain passages. Prompt i
    starts at passage i and runs on through the next ones (numbered past the last passage),
    so no two share a block past the chat template's own opening (its system prompt, which
    real chat traffic shares too).
    """
    template = _chat_frame(tokenizer, prompt_len)
    prompts = []
    for i in range(batch):
        start = i % len(PASSAGES)
        order = PASSAGES[start:] + PASSAGES[:start]
        text = (f"({i // len(PASSAGES)}) " if i >= len(PASSAGES) else "") + "\n\n".join(order)
        if template is None:
            prompts.append(_fill(tokenizer, tokenizer.encode(text, add_eos=False), order,
                                 prompt_len))
            continue
        before, after = template
        request = _plain(tokenizer, f"\n\n{REQUESTS[i % len(REQUESTS)]}")
        room = prompt_len - len(before) - len(after) - len(request)
        body = _fill(tokenizer, _plain(tokenizer, text), order, room) if room > 0 else []
        prompts.append((before + body + request)[:prompt_len - len(after)] + after)
    return prompts


def _chat_frame(tokenizer: Tokenizer, prompt_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids before and after the user's message; None without a chat template or
    when the frame would take more than a quarter of the prompt."""
    if tokenizer.spec.chat_template is None:
        return None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}])
    if rendered.count(_SLOT) != 1:
        return None
    before, after = (_plain(tokenizer, part) for part in rendered.split(_SLOT))
    return (before, after) if len(before) + len(after) <= prompt_len // 4 else None


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=False, add_eos=False)


def _fill(tokenizer: Tokenizer, ids: list[int], order: tuple[str, ...], length: int) -> list[int]:
    while len(ids) < length:  # longer than every passage together: keep going
        ids = ids + _plain(tokenizer, "\n\n" + "\n\n".join(order))
    return ids[:length]
