"""TFDS builders (array_record, no TensorFlow needed) for Amazon Beauty and the synthetic data.

Works without TensorFlow in tfds 4.9.10 because: the DatasetInfo is built directly
(`tfds.core.DatasetInfo(builder=self, ...)`; `dataset_info_from_configs` would look for metadata
files next to this module), `code_path = None` stops TFDS probing for checksum files
next to the module (that probe imports `importlib_resources`, absent here), features are
numpy-typed (`Scalar`, `Tensor`, `Text`, `Sequence`),
`file_format='array_record'` writes through array_record, and reading goes through
`builder.as_data_source()` (random access, no tf.data). `disable_shuffling` keeps records in
index order so record k of a split is user / item k.

Splits (leave-one-out, per user, time ordered):
  items:      item, raw_id, asin, title, brand ('' = none), categories, price (text; '' = none)
  train:      user, raw_user, history = seq[:-3], target = seq[-3]   (train inputs are seq[:-2])
  validation: user, raw_user, history = seq[:-2], target = seq[-2]
  test:       user, raw_user, history = seq[:-1], target = seq[-1], timestamps (whole sequence)
"""

from __future__ import annotations

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

from dgr2_jax.data import beauty
from dgr2_jax.data import synthetic


def _features():
  user = {
      "user": tfds.features.Scalar(np.int32),
      "raw_user": tfds.features.Text(),
      "history": tfds.features.Tensor(shape=(None,), dtype=np.int32),
      "target": tfds.features.Scalar(np.int32),
      "timestamps": tfds.features.Tensor(shape=(None,), dtype=np.int64),
  }
  item = {
      "item": tfds.features.Scalar(np.int32),
      "raw_id": tfds.features.Text(),
      "asin": tfds.features.Text(),
      "title": tfds.features.Text(),
      "brand": tfds.features.Text(),
      "categories": tfds.features.Sequence(tfds.features.Text()),
      # Text, because tf.train.Example stores floats as float32 (3.04 would come back 3.0399...).
      "price": tfds.features.Text(),
  }
  # One FeaturesDict for all splits (TFDS requires one); unused fields are empty.
  return tfds.features.FeaturesDict({**user, **item})


def _empty_user():
  return {"user": -1, "raw_user": "", "history": np.zeros([0], np.int32), "target": -1,
          "timestamps": np.zeros([0], np.int64)}


def _empty_item():
  return {"item": -1, "raw_id": "", "asin": "", "title": "", "brand": "", "categories": [],
          "price": ""}


class _SeqRecBuilder(tfds.core.GeneratorBasedBuilder):
  """Shared split logic; subclasses implement `_load()` -> beauty.process(...) output."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  # No checksums / metadata files next to this module; TFDS would otherwise probe for them via
  # `importlib_resources` (not installed here).
  code_path = None

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=_features(), disable_shuffling=True,
                                 description=self.__doc__)

  # tfds prints "Downloading and preparing dataset Unknown size (download: Unknown size, ...)" and
  # "Dataset ... downloaded and prepared" around every build, past any log level (these two hooks
  # of the pinned tfds). These builders download nothing: the records are generated, or read from
  # a local directory. tfds already logs "Generating dataset <name> (<dir>)" at INFO; the end of
  # the build goes there too (shown with --verbosity=0).
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    logging.info("Dataset %s built in %s", self.name, self.data_dir)

  def _load(self, dl_manager) -> dict:
    raise NotImplementedError

  def _split_generators(self, dl_manager):
    p = self._load(dl_manager)
    for u, s in enumerate(p["sequences"]):
      if len(s) < 3:
        raise ValueError(f"user {p['users'][u]!r} has {len(s)} interactions; leave-one-out needs >= 3")
    return {
        "items": self._generate_examples(("items", p)),
        "train": self._generate_examples(("train", p)),
        "validation": self._generate_examples(("validation", p)),
        "test": self._generate_examples(("test", p)),
    }

  def _generate_examples(self, arg):
    split, p = arg
    if split == "items":
      for it in p["items"]:
        yield it["item"], {**_empty_user(), "item": it["item"], "raw_id": it["raw_id"],
                           "asin": it["asin"], "title": it["title"], "brand": it["brand"] or "",
                           "categories": it["categories"],
                           "price": "" if it["price"] is None else repr(float(it["price"]))}
      return
    cut = {"train": 3, "validation": 2, "test": 1}[split]
    for u, (raw, seq, ts) in enumerate(zip(p["users"], p["sequences"], p["timestamps"])):
      yield u, {**_empty_item(), "user": u, "raw_user": raw,
                "history": np.asarray(seq[:-cut], np.int32), "target": seq[-cut],
                "timestamps": np.asarray(ts if split == "test" else [], np.int64)}


class AmazonBeauty(_SeqRecBuilder):
  """Amazon Review 'Beauty' 5-core under the TIGER protocol, from a manual directory."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put interactions.tsv.gz + items.jsonl, or McAuley's reviews_Beauty_5.json.gz + "
      "meta_Beauty.json.gz, in the manual dir.")

  def __init__(self, *, fmt: str = "auto", min_count: int = 5, **kwargs):
    self._fmt, self._min_count = fmt, min_count
    super().__init__(**kwargs)

  def _load(self, dl_manager):
    fmt, rows, items, paths = beauty.read_dir(str(dl_manager.manual_dir), self._fmt)
    return beauty.process(rows, items, self._min_count, paths.get("items") or paths.get("meta"))


class SyntheticSeqRec(_SeqRecBuilder):
  """Synthetic Beauty-like sequences (dgr2_jax.data.synthetic), same schema and protocol."""

  def __init__(self, *, synthetic_config=None, seed: int = 0, min_count: int = 5, **kwargs):
    self._cfg, self._seed, self._min_count = synthetic_config, seed, min_count
    super().__init__(**kwargs)

  def _load(self, dl_manager):
    rows, items = synthetic.generate(self._cfg, self._seed)
    items = {k: beauty.item_record(k, d, "synthetic item") for k, d in items.items()}
    return beauty.process(rows, items, self._min_count, "the synthetic items")


def build(data_cfg, seed: int, tfds_dir: str) -> None:
  """Builds the dataset selected by `data_cfg` (a `data` config section) under `tfds_dir`."""
  if data_cfg.source == "beauty":
    beauty.resolve_format(data_cfg.dir, data_cfg.format)  # fail before TFDS makes any folder
    b = AmazonBeauty(fmt=data_cfg.format, min_count=data_cfg.min_count, data_dir=tfds_dir,
                     file_format="array_record")
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=data_cfg.dir))
  elif data_cfg.source == "synthetic":
    b = SyntheticSeqRec(synthetic_config=data_cfg.synthetic, seed=seed,
                        min_count=data_cfg.min_count, data_dir=tfds_dir, file_format="array_record")
    b.download_and_prepare()
  else:
    raise ValueError(f"data.source must be 'beauty' or 'synthetic', got {data_cfg.source!r}")


def data_source(tfds_dir: str) -> dict:
  """{split: ArrayRecordDataSource} of the one dataset built under `tfds_dir` (no TF, no builder class)."""
  import glob
  import os
  found = sorted(glob.glob(os.path.join(tfds_dir, "*", "*", "dataset_info.json")))
  if len(found) != 1:
    raise FileNotFoundError(f"expected one built TFDS dataset under {tfds_dir!r}, found {len(found)}")
  return tfds.builder_from_directory(os.path.dirname(found[0])).as_data_source()
