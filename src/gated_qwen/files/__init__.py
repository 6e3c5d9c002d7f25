"""The package's file-system safety: every file and folder it writes (`convert`, `analyze`, `eval-ppl`, `reproduce`,
`card`) goes through here, and every file a user gives it is read through here.

The rules, written once:
- **Never into, over or around an input, by file identity.** Files and folders are compared by what they are
  (device and inode), not by their paths, so a second path to the same folder (a bind mount, a case-insensitive file
  system, a hard link, a symlink at any depth) is recognised. An input is every file and folder a command may read:
  each input given, and, for a folder, everything under it, links followed, and every file an index in it names
  (a shard `../shared/x`, which Transformers follows, wherever it lies). An output is refused before anything is
  read or written (`check_output`) when it is one of those, lies inside one (one of its folders is an input folder),
  or would replace something that holds one (the old output is walked as its removal would walk it, mount points
  included); the current folder counts as an input. Also refused: an output that is, lies inside or holds a Hugging
  Face cache (the configured HF_HOME and hub cache, a folder of `models--*/` repositories, a repository: a
  snapshot's files are links into blobs that other snapshots share), an output that is or holds a mount point
  (renaming it or removing it would fail half-way or reach into the mounted file system), a name longer than the
  file system allows.
  A file output never writes through a link: a link in its place is replaced, its target left as it is.
- **Whole or not at all.** The output is built in a staging folder beside it, `.NAME.writing-PID-XXXXXXXX/NAME`,
  and renamed into place only when complete; on any failure (a full disk included, said as such) the staging folder
  and the parent folders this run created are removed.
- **Replaced only when asked, and only by a complete new one.** An existing output (other than an empty folder) is
  refused without `overwrite`; with it, the old one is moved aside into `.NAME.replaced-PID-XXXXXXXX/NAME` just
  before the new one is renamed into place, and removed afterwards.
- **Nothing left behind, no live run disturbed.** Each staging folder holds this project's owner record,
  `owner.json` (`"by": "gated-qwen"`, process, host, output name), which the run holds an exclusive `flock` on for
  its whole life: the lock, not the process id, says whether the run is live (a process id means nothing in another
  PID namespace, e.g. a container sharing the volume). A staging folder whose lock is free (its run was killed) is
  removed by the next run that writes that output, or by `clean_stale(path)` (`gated-qwen convert --clean PATH`),
  which say what they removed; a `.replaced-` folder whose output is missing (a run killed between the two renames)
  is moved back into place first. A folder without this project's owner record is never removed, whatever its name.

One module per job: `identity.py` (what an output may not be, checked before anything is written: `check_output`),
`staging.py` (owner records, staging and publishing: `output_folder`, `output_file`, `clean_stale`), `scratch.py`
(a run's temporary folders: `scratch_folder`, `clean_stale_scratch`), `reading.py` (what the package reads: JSON
objects, a config.json's values, safetensors headers, each refused in one line) and `memory.py` (how much memory
this process can still allocate).
"""

from __future__ import annotations

from .identity import OutputError, check_output
from .reading import (
    CONFIG_VALUE_ERRORS,
    check_safetensors_files,
    config_from_dict,
    parse_json,
    read_json_object,
)
from .scratch import clean_stale_scratch, scratch_folder
from .staging import OWNER_FILE, clean_stale, output_file, output_folder, say, write_json

__all__ = [
    "CONFIG_VALUE_ERRORS", "OWNER_FILE", "OutputError", "check_output", "check_safetensors_files", "clean_stale",
    "clean_stale_scratch", "config_from_dict", "output_file", "output_folder", "parse_json", "read_json_object", "say",
    "scratch_folder", "write_json",
]
