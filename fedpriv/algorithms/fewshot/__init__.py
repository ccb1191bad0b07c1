"""Task-level DP meta-learning of a network on few-shot image tasks (Zhou & Bassily 2022,
Appendix C): the three algorithms of ``fedpriv.algorithms.meta`` with a torch network's
embedding as the meta-model.

Users are tasks (``fedpriv.data.fewshot``): task t is N classes of an image pool in a seeded
order (labels 0..N-1 permuted per task), K support and Q query images a class, a pure
function of (seed, t). Task-level DP: one task's whole data (support and query) is what a
neighbouring dataset changes.

A task adapts the embedding (the body of a deep-family network: ``mlp``, ``cnn``, ``conv4``
or a factory; its last linear layer is unused) to its support: prototypes (the classes' mean
support embeddings) and, with ``adapt-steps = s``, s closed-form gradient steps of a linear
head started from them (``fewshot_math.adapted_logits``). Its **meta-gradient** is the
gradient of its adapted query cross-entropy with respect to the embedding, through the
adaptation (``meta-gradient = "unrolled"``) or with the adapted prototypes and head held fixed
(``"first-order"``). Each task's meta-gradient is clipped to ``clip-norm`` on the node (ghost
clipping where the body is linear and convolutional layers: no per-task gradient formed);
the server divides the sum by the public population, adds the planned Gaussian noise and steps
with the schedule of ``fedpriv.algorithms.meta.schedule`` -- the same strategy, accountant,
ledger and release as every algorithm:

* ``fewshot-meta-nsgd`` (Algorithm 1; ``fewshot-meta-sgd`` without noise): T rounds over
  Poisson samples of the tasks, a projected gradient step; releases the last iterate (a
  network's iterates are not averaged, a post-processing choice).
* ``fewshot-private-meta-cluster`` (Algorithm 2; ``fewshot-meta-cluster``): q networks from q
  seeded initializations; a task sends its meta-gradient in the row of the network whose
  prototypes separate its support best, zeros elsewhere (the same sensitivity).
* ``fewshot-dp-ftmrl`` (``fewshot-ftmrl``): every task once in T disjoint batches, tree noise.
* ``fewshot-local``: each fresh task trained alone (a linear model on its support pixels).

Evaluation (the final step): one fresh meta-test task per task id (the test split's images
for a built-in dataset; Omniglot's evaluation characters), adapted with the released
embedding (choosing among q by support loss) and scored on its queries: ``transfer_accuracy``;
``local_accuracy`` is the same task trained alone.

Files: ``params`` (keys), ``problem`` (the pool, the network, a chunk of tasks as tensors),
``fewshot_math`` (adaptation, losses, clipped meta-gradients, scores), ``algorithms`` (the
registered classes). Torch is loaded only when one is asked for (``deep.without_torch``).
"""
