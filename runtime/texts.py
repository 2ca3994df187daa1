"""Text as model input: UTF-8 files read with a clear error, token ids cut into windows,
and short English passages built into the package.

`windows_of` is the one way text becomes model input windows: evaluation, calibration,
quality probes and distillation alike. The passages are plain prose on unrelated everyday
topics, written for this file (no dataset is needed): bench prompts are made from them, and
the compiler's quality probe reads them where a model is too large to sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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


def windows_of(token_ids: Sequence[int], seq_len: int, windows: int | None = None,
               minimum: int = 1, source: str = "the text") -> list[list[int]]:
    """The first `windows` (None: all) non-overlapping windows of `seq_len` tokens; at
    least `minimum` must fit. The one way text becomes model input windows: evaluation,
    calibration, quality probes and distillation alike."""
    available = len(token_ids) // seq_len
    if available < minimum:
        raise ValueError(f"{source} has {len(token_ids)} tokens: {available} windows of "
                         f"{seq_len}, fewer than the {minimum} needed")
    count = available if windows is None else min(windows, available)
    return [list(token_ids[i * seq_len:(i + 1) * seq_len]) for i in range(count)]


def read_text(text_file: str | Path) -> str:
    """A UTF-8 text file's contents; a clear error for anything else."""
    try:
        return Path(text_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{text_file} is not UTF-8 text (byte {exc.start} cannot be "
                         "decoded)") from None
