"""Reads a directory of event files with TensorBoard's own readers and prints what they
hold as JSON: the reader `tensorboard --logdir` and `wandb sync --sync-tensorboard`
use (EventFileLoader, which checks every record's CRC), and EventAccumulator, which
merges a directory's files into series.

usage: tensorboard_check.py DIR
"""

import glob
import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader


def main() -> None:
    logdir = sys.argv[1]
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    versions = []
    for path in files:
        # Raises on a bad length or data CRC (tensorboard's own record reader).
        loader = event_file_loader.RawEventFileLoader(path, detect_file_replacement=False)
        records = list(loader.Load())
        from tensorboard.compat.proto import event_pb2

        first = event_pb2.Event.FromString(records[0])
        versions.append(first.file_version)
    acc = event_accumulator.EventAccumulator(
        logdir,
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    out = {
        "files": len(files),
        "versions": versions,
        "scalars": {
            tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in tags["scalars"]
        },
        "histograms": {
            tag: [
                {
                    "step": e.step,
                    "num": e.histogram_value.num,
                    "min": e.histogram_value.min,
                    "max": e.histogram_value.max,
                    "counts": sum(e.histogram_value.bucket),
                }
                for e in acc.Histograms(tag)
            ]
            for tag in tags["histograms"]
        },
        "text": {
            tag: [
                [e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(tag)
            ]
            for tag in tags["tensors"]
        },
        "plugins": {
            tag: acc.SummaryMetadata(tag).plugin_data.plugin_name for tag in tags["tensors"]
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
