"""What the project's console must not show."""

from __future__ import annotations

import re

# What a third-party line looks like on the console: a logging prefix, a timestamp, Ray's C++ log prefix, a Ray
# worker's forwarded output, a Python warning or a progress bar.
FOREIGN = re.compile(r"^\s*(INFO|WARNING|WARN|ERROR|DEBUG)\b|^\d{4}-\d\d-\d\d[ T]|^\[\d{4}-\d\d-\d\d|pid=\d+\)|"
                     r"\((MapWorker|RayTrainWorker|TrainController|SplitCoordinator|EngineCore|raylet)|"
                     r"Warning:|\d+%\|")
