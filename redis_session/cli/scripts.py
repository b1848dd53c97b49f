"""The demo's scripted conversations: a coding agent, a support chat and a research agent, each a
few turns of a user message, tool steps (a thought, a call, a result) and a streamed answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolStep:
    thought: str
    tool: str
    args: dict[str, Any]
    result: str


@dataclass(frozen=True)
class Turn:
    user: str
    answer: str
    steps: tuple[ToolStep, ...] = ()


@dataclass(frozen=True)
class Script:
    kind: str
    title: str
    turns: tuple[Turn, ...]
    branch: Turn = field(default_factory=lambda: Turn("Try another way.", "Done another way."))


CODING = Script(
    "coding",
    "coding agent · fix the failing test",
    (
        Turn(
            "CI says test_parse_dates fails on main. Can you fix it?",
            "Found it: parse() read ISO dates as day-month-year. It now splits year-month-day, and the "
            "suite passes (12 passed).",
            (
                ToolStep(
                    "Let me run the failing test first.",
                    "run_tests",
                    {"path": "tests/test_dates.py"},
                    "1 failed: test_parse_dates - ValueError: month must be in 1..12, got 24",
                ),
                ToolStep(
                    "Month 24 looks like a day. Reading the parser.",
                    "read_file",
                    {"path": "src/dates.py", "lines": "10-18"},
                    "def parse(s):\n    d, m, y = s.split('-')\n    return date(int(y), int(m), int(d))",
                ),
            ),
        ),
        Turn(
            "Great. Add a test for a leap day too.",
            "Added test_parse_leap_day for 2024-02-29; all 13 tests pass.",
            (
                ToolStep(
                    "Writing the test, then running the suite.",
                    "run_tests",
                    {"path": "tests/"},
                    "13 passed in 0.41s",
                ),
            ),
        ),
        Turn("Thanks, open a PR please.", "Opened PR #482: 'Parse ISO dates as Y-M-D, test leap days'."),
    ),
    Turn(
        "Actually, use datetime.date.fromisoformat instead of splitting by hand.",
        "Switched parse() to date.fromisoformat; it rejects bad input with a clear error. 13 passed.",
        (ToolStep("Replacing the parser and re-running.", "run_tests", {"path": "tests/"}, "13 passed in 0.38s"),),
    ),
)

SUPPORT = Script(
    "support",
    "support chat · a late order",
    (
        Turn(
            "Hi, my order #A1043 was supposed to arrive yesterday.",
            "Sorry about that! Order #A1043 left our warehouse on Monday and is with the carrier; the "
            "tracking shows a one-day delay at the Lyon hub. It should arrive tomorrow before noon.",
            (
                ToolStep(
                    "Looking up the order.",
                    "lookup_order",
                    {"order": "A1043"},
                    "status: shipped (Mon), carrier: DPD, tracking: delayed at Lyon hub, eta: tomorrow 12:00",
                ),
            ),
        ),
        Turn(
            "Can you refund the express shipping then?",
            "Done: the 9.90 EUR express fee is refunded to your card; you will see it within 3 days.",
            (
                ToolStep(
                    "Express was paid and not delivered in time: eligible. Issuing the refund.",
                    "refund",
                    {"order": "A1043", "item": "express-shipping", "amount": 9.9},
                    "refund R-7781 issued: 9.90 EUR to card ending 4242",
                ),
            ),
        ),
        Turn("Perfect, thank you!", "You're welcome! Anything else I can help with?"),
    ),
    Turn(
        "Could I get store credit instead of a refund?",
        "Of course: 12.00 EUR store credit (the fee plus a bit for the trouble) is on your account.",
        (ToolStep("Issuing store credit.", "store_credit", {"order": "A1043", "amount": 12.0}, "credit C-201 added"),),
    ),
)

RESEARCH = Script(
    "research",
    "research agent · heat pumps in cold climates",
    (
        Turn(
            "Do heat pumps still work at -20 °C?",
            "Yes: cold-climate air-source heat pumps keep heating at -20 °C, at a lower efficiency "
            "(a COP around 1.5-2 against 3-4 at +7 °C). Field trials in Norway and Canada found them "
            "cheaper to run than resistive heating even in the coldest months.",
            (
                ToolStep(
                    "Searching for field measurements, not just datasheets.",
                    "web_search",
                    {"query": "cold climate heat pump field trial COP -20C"},
                    "3 results: NRCan field study (2023); SINTEF Norway monitoring report; NEEP product list",
                ),
                ToolStep(
                    "Reading the Canadian field study.",
                    "fetch",
                    {"url": "https://example.org/nrcan-ccashp-2023"},
                    "Measured seasonal COP 2.3; at -20 °C COP 1.6; backup heat used 4% of hours.",
                ),
            ),
        ),
        Turn(
            "And how does that compare to a gas boiler on cost?",
            "At typical European prices (0.25 EUR/kWh power, 0.09 EUR/kWh gas) a COP above ~2.6 beats a "
            "90 %-efficient boiler; over a whole season most cold-climate units clear that.",
            (
                ToolStep(
                    "Computing the break-even COP.",
                    "python",
                    {"code": "0.25 / (0.09 / 0.90)"},
                    "2.5",
                ),
            ),
        ),
    ),
    Turn(
        "Redo the cost comparison with US prices.",
        "With US averages (0.16 USD/kWh power, 0.05 USD/kWh gas) the break-even COP is ~2.9: a "
        "closer call in the coldest states, a clear win elsewhere.",
        (ToolStep("Recomputing.", "python", {"code": "0.16 / (0.05 / 0.90)"}, "2.88"),),
    ),
)

SCRIPTS = (CODING, SUPPORT, RESEARCH)
