"""Subprocess body for the multi-replica tests (device set-up must precede TF use).

Usage: python distribute_worker.py MODE JSON_ARGS; prints one JSON line "RESULT {...}".
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

keras.config.disable_traceback_filtering()


def logical_cpus(count):
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def zero_gradient_update(strategy, sigma, clip, batch, accumulation, seed):
    import keras
    import keras_dp_lm as kdp
    with strategy.scope():
        model = keras.Sequential([keras.Input((50,)), keras.layers.Dense(2000, use_bias=False)])
        model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma,
                                          seed=seed, gradient_accumulation_steps=accumulation),
                      loss="mse")
    before = model.trainable_variables[0].numpy().copy()
    model.fit(np.ones((batch, 50), "float32"), np.zeros((batch, 2000), "float32"),
              sample_weight=np.zeros(batch, "float32"), batch_size=batch, epochs=1,
              verbose=0, shuffle=False)
    delta = model.trainable_variables[0].numpy() - before
    return {"std": float(delta.std()), "expected": sigma * clip / batch,
            "updates": int(model.optimizer.dp_updates.numpy()),
            "divisor": float(model.optimizer.dp_last_batch_size.numpy())}


def tiny_training(strategy, accumulation, steps, batch, jit=False, steps_per_execution=1,
                  optimizer="sgd"):
    """sigma = 0 training on fixed data; returns the final weights."""
    import keras
    import keras_dp_lm as kdp
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 6)).astype("float32")
    y = rng.integers(0, 3, batch * steps)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        cls = kdp.DPSGD if optimizer == "sgd" else kdp.DPAdam
        model.compile(optimizer=cls(0.5 if optimizer == "sgd" else 0.05, l2_norm_clip=0.3,
                                    noise_multiplier=0.0,
                                    gradient_accumulation_steps=accumulation),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit, steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return {"weights": [w.numpy().tolist() for w in model.trainable_variables],
            "updates": int(model.optimizer.dp_updates.numpy())}


def poisson_fit(strategy, unit, steps, seed, num_replicas=2, padding="bucket"):
    """sigma = 0 ``fit`` on Poisson example (bucket-padded) or user batches;
    returns the final weights and the ledger rows."""
    import keras
    import keras_dp_lm as kdp
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    n = 120
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    if unit == "user":
        users = np.arange(n) // 3  # 40 users of 3 records
        batches = kdp.data.poisson_user_batches(
            (x, y), users, 0.25, max_users=23, examples_per_user=2, seed=seed,
            num_replicas=num_replicas, num_steps=steps, padding=padding)
    else:
        batches = kdp.data.poisson_batches((x, y), 0.2, 48, seed=seed, num_steps=steps,
                                           padding="bucket")
    expected = batches.sampling_rate * batches.dataset_size
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=kdp.DPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=0.0,
                                          expected_batch_size=expected),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(batches, epochs=1, verbose=0)
    ledger = kdp.ledger_of(model)
    return {"weights": [w.numpy().tolist() for w in model.trainable_variables],
            "rows": np.asarray(ledger.rows()).tolist(), "unit": ledger.privacy_unit,
            "updates": int(model.optimizer.dp_updates.numpy())}


_STRATEGIES = {}


def mirrored(replicas):
    """One MirroredStrategy per replica count for the whole process (two
    strategies over the same devices would reuse collective instance keys)."""
    if replicas not in _STRATEGIES:
        names = [d.name for d in tf.config.list_logical_devices("CPU")]
        _STRATEGIES[replicas] = tf.distribute.MirroredStrategy(names[:replicas])
    return _STRATEGIES[replicas]


def run_job(mode, args):
    """One case; MirroredStrategy cases need ``logical_cpus(2)`` called first."""
    if mode == "noise":
        strategy = mirrored(args["replicas"])
        return zero_gradient_update(strategy, args["sigma"], args["clip"], args["batch"],
                                    args.get("accumulation", 1), args.get("seed", 1))
    if mode == "train":
        strategy = mirrored(args["replicas"])
        return tiny_training(strategy, args.get("accumulation", 1), args["steps"],
                             args["batch"], args.get("jit", False), args.get("spe", 1))
    if mode == "poisson_fit":
        strategy = mirrored(args["replicas"])
        out = {unit: poisson_fit(strategy, unit, args["steps"], args["seed"])
               for unit in ("example", "user")}
        if args["replicas"] == 2:
            # 23 user slots split over 2 replicas cut a user's rows apart
            try:
                poisson_fit(strategy, "user", 1, 0, num_replicas=1, padding="max")
                out["uneven"] = "trained"
            except (ValueError, tf.errors.InvalidArgumentError) as error:
                out["uneven"] = str(error)
        return out
    if mode == "single_adam":
        return tiny_training(tf.distribute.get_strategy(), 1, args["steps"], args["batch"],
                             optimizer="adam")
    raise SystemExit(f"unknown mode {mode}")


def main():
    """``MODE ARGS`` runs one case; ``jobs {"name": [MODE, ARGS], ...}`` runs many
    in one process (one TensorFlow start-up) and prints them by name."""
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    if mode == "multiworker":
        # TF_CONFIG is set by the parent; one CPU device per worker process.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        out = tiny_training(strategy, 1, args["steps"], args["batch"], optimizer="adam")
        out["replicas"] = strategy.num_replicas_in_sync
    elif mode == "jobs":
        logical_cpus(2)
        out = {name: run_job(*job) for name, job in args.items()}
    else:
        logical_cpus(2)
        out = run_job(mode, args)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
