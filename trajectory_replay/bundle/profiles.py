"""Convention profiles: what each training framework's defaults amount to, in recompute-config fields.

Frameworks compute the same named algorithm with different conventions (biased or unbiased std, the eps
added to it, what a group of one becomes, whether advantages are masked, how a loss is aggregated, which
clamps guard the log ratios). A profile fixes those for one framework at one version, and translates the
framework's own option names and values into ours, so a producer records exactly what production did:

    RecomputeConfig.from_profile("verl", norm_adv_by_std_in_grpo=False, loss_agg_mode="seq-mean-token-mean")

The config (`bundle/schema.py`) builds itself from a profile here and remembers it; the bundle's manifest records
it (`Manifest.conventions`). `trajectory-replay conventions <bundle>` replays a bundle under every profile to tell
which one production followed. docs/conventions.md lists what each framework does that no field expresses.

Profiles are versioned where a framework's conventions changed between releases: `verl-0.8` and `verl-0.9`,
`trl-1.10` and `trl-1.16` are pinned, and a framework's bare name (`verl`, `trl`) is its newest modelled version
(`NEWEST`). A bundle built from a profile takes the framework's option names in `replay --set` too
(`Profile.changes`), and `trajectory-replay conventions` tries the values of its closed options (`Option.values`).
A value of a framework option that no field expresses is refused in one line naming the option (`Profile.fields`),
never passed on as a value the config's fields do not mean.

Pure data and functions over field names: the schema imports this module, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

CONVENTION_FIELDS = (
    "group_size_check",
    "grpo_std_normalization",
    "std_unbiased",
    "std_eps",
    "singleton_group",
    "mask_advantages",
    "masked_return",
    "kl_in_score",
    "kl_log_ratio_clamp",
    "kl_output_clamp",
    "kl_clamped",
    "eps_clip_c",
    "ratio_log_clamp",
    "loss_agg_mode",
    "clip_metric_agg",
    "kl_loss_estimator",
    "std_scope",
    "nan_rewards",
    "cispo_clip",
    "entropy_agg",
    "kl_loss_ratio_weighted",
)
"""The fields a framework decides by convention (or by a default users rarely change). Applying a profile to a
recorded config (`RecomputeConfig.with_conventions_of`) changes these and keeps the run's own hyperparameters
(kl_coef, eps_clip, n_samples_per_prompt, the recorded denominators, ...)."""


@dataclass(frozen=True)
class Option:
    """A framework option: the config field it sets, and how its value translates (None: taken as is)."""

    field: str
    translate: Callable[[Any], Mapping[str, Any]] | None = None
    """Maps the option's value to one or more fields, e.g. verl's 'token-mean' -> loss_agg_mode token_mean."""
    jointly: Callable[[Any, Mapping[str, Any]], Mapping[str, Any]] | None = None
    """For an option whose meaning depends on others (verl's rollout_rs_threshold on rollout_rs): maps its value
    and the fields the other options and overrides set (and, under names no field has, the other options as given)
    to the fields it sets; it is applied after them."""
    values: tuple[Any, ...] = ()
    """The framework's values of a closed option, which `trajectory-replay conventions` tries on a bundle built from
    the profile (by the option's name: `loss_type=grpo`)."""

    def fields(self, value: Any, others: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
        """The config fields this option's `value` sets, given the fields set by the others (`jointly`)."""
        if self.jointly is not None:
            return self.jointly(value, others or {})
        return self.translate(value) if self.translate is not None else {self.field: value}


@dataclass(frozen=True)
class Profile:
    """One framework's conventions at one version."""

    name: str
    framework: str
    framework_version: str
    settings: Mapping[str, Any]
    """Config fields that differ from the defaults (the defaults are the `relax` profile)."""
    options: Mapping[str, Option] = field(default_factory=dict)
    """The framework's option names, for `from_profile` overrides."""

    package: str | None = None
    """The distribution the framework installs as, which `installed_version` reads (None: not looked up)."""

    def fields(self, overrides: Mapping[str, Any], config_fields: Collection[str]) -> dict[str, Any]:
        """The config fields this profile with `overrides` (the framework's option names, or names among
        `config_fields`) sets; ValueError naming an override that is neither, or an option whose value no field
        expresses."""
        fields = dict(self.settings)
        joint = {k: v for k, v in overrides.items() if k in self.options and self.options[k].jointly is not None}
        for key, value in overrides.items():
            if key not in joint:
                fields.update(self.override(key, value, config_fields))
        for key, value in joint.items():
            fields.update(self.override(key, value, config_fields, {**overrides, **fields}))
        return fields

    def changes(
        self, overrides: Mapping[str, Any], current: Mapping[str, Any], config_fields: Collection[str]
    ) -> dict[str, Any]:
        """The config fields `overrides` change on a config whose fields are `current` (`replay --set` on a bundle
        built from this profile): a config field by its own name (a name that is both means the field there), a
        framework option as `fields` translates it (an option that reads others sees `current` with the rest of
        `overrides` applied); ValueError naming an override that is neither, or a value no field expresses."""
        out: dict[str, Any] = {}
        joint = []
        for key, value in overrides.items():
            if key in config_fields:
                out[key] = value
            elif key in self.options and self.options[key].jointly is not None:
                joint.append((key, value))
            else:
                out.update(self.override(key, value, config_fields))
        for key, value in joint:
            out.update(self.override(key, value, config_fields, {**overrides, **current, **out}))
        return out

    def override(
        self, key: str, value: Any, config_fields: Collection[str], others: Mapping[str, Any] | None = None
    ) -> Mapping[str, Any]:
        """The config fields one override sets (see `fields`), given the fields the others set (`Option.jointly`)."""
        if key in self.options:  # a name both spell (verl's kl_loss_type) means what the framework means by it
            try:
                return self.options[key].fields(value, others)
            except ValueError as exc:
                raise ValueError(f"{self.describe(key, value)}: {exc}") from None
        if key in config_fields:
            return {key: value}
        known = ", ".join(self.options) or "none"
        raise ValueError(
            f"{key!r} is neither a recompute config field nor a {self.framework} option of "
            f"profile {self.name!r} (its options: {known})"
        )

    def describe(self, key: str, value: Any) -> str:
        """How an error names override `key`: the framework's option of this profile, or our config field."""
        if key in self.options:
            return f"{self.framework} option {key}={value!r} (profile {self.name})"
        return f"config field {key}={value!r}"

    def refusal(
        self, field_name: str, problem: str, overrides: Mapping[str, Any], config_fields: Collection[str]
    ) -> str:
        """One line for config field `field_name` refusing the value `overrides` gave it: the override that set it
        (the framework's option, by its own name) and the `problem`."""
        for key, value in overrides.items():
            if field_name in self.override(key, value, config_fields):
                return f"{self.describe(key, value)}: field {field_name} refuses it ({problem})"
        return f"profile {self.name}: field {field_name} refuses its value ({problem})"


def _mode(value: Any) -> dict[str, Any]:
    """A loss aggregation mode spelled with hyphens (verl) or underscores."""
    return {"loss_agg_mode": str(value).replace("-", "_")}


def _named(field_name: str, names: Mapping[str, str]) -> Callable[[Any], Mapping[str, Any]]:
    """A value translated through a table of the framework's names (unlisted values pass through)."""
    return lambda value: {field_name: names.get(str(value), value)}


def _choices(field_name: str, table: Mapping[str, Mapping[str, Any]]) -> Callable[[Any], Mapping[str, Any]]:
    """A value that picks several fields from a table of the framework's values (unlisted values set `field_name`)."""
    return lambda value: table.get(str(value), {field_name: value})


def _both(*fields: str) -> Callable[[Any], Mapping[str, Any]]:
    """One framework option that sets several of our fields to the same value."""
    return lambda value: dict.fromkeys(fields, value)


def _one_of(field_name: str, table: Mapping[Any, Any]) -> Callable[[Any], Mapping[str, Any]]:
    """A value from a closed table of the framework's values -> `field_name`'s value; any other value is refused
    (ValueError listing the values the table knows)."""

    def translate(value: Any) -> Mapping[str, Any]:
        key = value if value is None else str(value)
        if key not in table:
            known = ", ".join("null" if k is None else str(k) for k in table)
            raise ValueError(f"no recompute config field expresses this value (known values: {known})")
        return {field_name: table[key]}

    return translate


def _one_of_fields(table: Mapping[Any, Mapping[str, Any]]) -> Callable[[Any], Mapping[str, Any]]:
    """A value from a closed table of the framework's values -> the fields it sets (`_one_of` for several fields);
    any other value is refused (ValueError listing the values the table knows)."""

    def translate(value: Any) -> Mapping[str, Any]:
        key = value if value is None else str(value)
        if key not in table:
            known = ", ".join("null" if k is None else str(k) for k in table)
            raise ValueError(f"no recompute config field expresses this value (known values: {known})")
        return table[key]

    return translate


def _parse_number(value: Any) -> float:
    """A number a framework's config holds as a number or a string; ValueError for anything else, a bool or a
    string that spells no number (a window such as verl's '0.9_1.1') included."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, not {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number, not {value!r}") from None


def _number(*fields: str) -> Callable[[Any], Mapping[str, Any]]:
    """A numeric option setting `fields`; anything but a number is refused (`_parse_number`)."""

    def translate(value: Any) -> Mapping[str, Any]:
        try:
            number = _parse_number(value)
        except ValueError:
            raise ValueError("no recompute config field expresses this value (expected a number)") from None
        return dict.fromkeys(fields, number)

    return translate


def _only(*values: Any) -> Callable[[Any], Mapping[str, Any]]:
    """An option no field expresses: replay reproduces it at `values` (which set nothing) and refuses any other."""

    def translate(value: Any) -> Mapping[str, Any]:
        if value not in values:
            known = ", ".join("null" if v is None else repr(v) for v in values)
            raise ValueError(f"no recompute config field expresses this option (replayable only as {known})")
        return {}

    return translate


def _verl_is_threshold(value: Any) -> Mapping[str, Any]:
    """verl's rollout_is_threshold: a number truncates the weights at it; 'lower_upper' zeroes the weights outside
    the window (IcePop)."""
    if isinstance(value, str) and "_" in value:
        lower, upper = value.split("_", 1)
        return {
            "rollout_is_threshold": _parse_number(upper),
            "rollout_is_threshold_lower": _parse_number(lower),
        }
    return {"rollout_is_threshold": _parse_number(value), "rollout_is_threshold_lower": None}


def _verl_rollout_rs(value: Any) -> Mapping[str, Any]:
    """verl's rollout_rs: null is off; a comma-separated list of criteria is kept as one string, without spaces."""
    if value is None:
        return {"rollout_rs": "none"}
    return {"rollout_rs": ",".join(part.strip() for part in str(value).split(",") if part.strip()) or "none"}


def _verl_rs_threshold(value: Any, others: Mapping[str, Any]) -> Mapping[str, Any]:
    """verl's rollout_rs_threshold, read with the rollout_rs it goes with: the upper ratio bound of the token and
    sequence modes, or one spec per divergence criterion (one spec shared by all of them). verl's k1 spec
    'lower_upper' bounds the ratio engine / trainer, so ours, trainer / engine, is [1 / upper, 1 / lower]; a single
    number u is the window [1 / u, u] either way. A k2 or k3 spec is one upper bound."""
    rs = str(others.get("rollout_rs", "none"))
    if rs in ("none", "token", "sequence"):
        return {} if value is None else {"rollout_rs_upper": _parse_number(value)}
    criteria = list(dict.fromkeys(rs.split(",")))
    if value is None:
        raise ValueError(f"a threshold is needed with rollout_rs={rs!r}")
    specs = [part.strip() for part in str(value).split(",") if part.strip()]
    if len(specs) == 1:
        specs *= len(criteria)
    if len(specs) != len(criteria):
        raise ValueError(f"one spec, or one per rollout_rs criterion ({len(criteria)})")
    bounds: dict[str, dict[str, float | None]] = {}
    for name, spec in zip(criteria, specs):
        if name.endswith("k1"):
            if "_" in spec:
                low, high = (_parse_number(v) for v in spec.split("_", 1))
                bounds[name] = {"lower": 1.0 / high, "upper": 1.0 / low}
            else:
                high = _parse_number(spec)
                bounds[name] = {"lower": 1.0 / high, "upper": high}
        elif "_" in spec:
            raise ValueError(f"criterion {name} takes one upper bound")
        else:
            bounds[name] = {"lower": None, "upper": _parse_number(spec)}
    return {"rollout_rs_bounds": bounds}


_VERL_KL = {"kl": "k1", "mse": "k2", "k3+": "k3", "low_var_kl+": "low_var_kl"}

_VERL_0_8 = Profile(
    "verl-0.8",
    "verl",
    "0.8.0.dev (b178a3cd)",
    {
        "group_size_check": "any",
        "grpo_std_normalization": True,
        "singleton_group": "unit",
        "mask_advantages": True,
        "kl_in_score": True,
        "kl_log_ratio_clamp": 20.0,
        "kl_output_clamp": 10.0,
        "kl_clamped": ["k3", "low_var_kl"],
        "eps_clip_c": 3.0,
        "ratio_log_clamp": 20.0,
        "loss_agg_mode": "token_mean",
        "clip_metric_agg": "micro_batch_token_mean",
        "kl_loss_estimator": "low_var_kl",
        "cliprange_value": 0.5,
    },
    {
        "adv_estimator": Option("advantage_estimator"),
        "norm_adv_by_std_in_grpo": Option("grpo_std_normalization"),
        "clip_ratio": Option("eps_clip", _both("eps_clip", "eps_clip_high")),
        "clip_ratio_low": Option("eps_clip"),
        "clip_ratio_high": Option("eps_clip_high"),
        "clip_ratio_c": Option("eps_clip_c"),
        "loss_agg_mode": Option("loss_agg_mode", _mode),
        "entropy_coeff": Option("entropy_coef"),
        "kl_loss_type": Option("kl_loss_estimator", _named("kl_loss_estimator", _VERL_KL)),
        "kl_penalty": Option("kl_loss_type", _named("kl_loss_type", _VERL_KL)),
        "use_kl_in_reward": Option("kl_in_reward"),
        "loss_mode": Option("policy_loss", _named("policy_loss", {"vanilla": "ppo_clip"})),
        # algorithm.rollout_correction: null means off
        "rollout_is": Option("rollout_is", lambda v: {"rollout_is": "none" if v is None else v}),
        "rollout_rs": Option("rollout_rs", lambda v: {"rollout_rs": "none" if v is None else v}),
        "rollout_rs_threshold": Option("rollout_rs_upper"),
        "rollout_rs_threshold_lower": Option("rollout_rs_lower"),
    },
    package="verl",
)
"""verl at the commit the first profile was read from (its legacy worker and rollout-correction options)."""

_VERL_KL_0_9 = {
    "kl": "k1",
    "k1": "k1",
    "kl+": "k1",
    "k1+": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "k3": "k3",
    "k3+": "k3",
    "low_var_kl": "low_var_kl",
    "low_var_kl+": "low_var_kl",
}
"""verl 0.9's KL estimators (core_algos.kl_penalty; a '+' is a straight-through gradient, the same values)."""

_VERL_0_9 = Profile(
    "verl-0.9",
    "verl",
    "0.9.1",
    {**_VERL_0_8.settings, "masked_return": "carry"},
    {
        "adv_estimator": Option(
            "advantage_estimator",
            _one_of(
                "advantage_estimator",
                {e: e for e in ("gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")},
            ),
        ),
        "norm_adv_by_std_in_grpo": Option("grpo_std_normalization"),
        "gamma": Option("gamma", _number("gamma")),
        "lam": Option("lam", _number("lam")),
        "clip_ratio": Option("eps_clip", _number("eps_clip", "eps_clip_high")),
        "clip_ratio_low": Option("eps_clip", _number("eps_clip")),
        "clip_ratio_high": Option("eps_clip_high", _number("eps_clip_high")),
        "clip_ratio_c": Option("eps_clip_c", _number("eps_clip_c")),
        "cliprange_value": Option("cliprange_value", _number("cliprange_value")),
        "loss_agg_mode": Option(
            "loss_agg_mode",
            _one_of(
                "loss_agg_mode",
                {
                    **{m: m.replace("-", "_") for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")},
                    "token-sum": "token_sum",
                    # 0.9 divides the sequence mean of token sums by the factor (ours of that name: the token sum)
                    "seq-mean-token-sum-norm": "seq_mean_token_sum_scaled",
                },
            ),
        ),
        "entropy_coeff": Option("entropy_coef", _number("entropy_coef")),
        "kl_loss_coef": Option("kl_loss_coef", _number("kl_loss_coef")),
        "kl_loss_type": Option("kl_loss_estimator", _one_of("kl_loss_estimator", _VERL_KL_0_9)),
        "kl_penalty": Option("kl_loss_type", _one_of("kl_loss_type", _VERL_KL_0_9)),
        "use_kl_in_reward": Option("kl_in_reward"),
        "loss_mode": Option(
            "policy_loss",
            _one_of("policy_loss", {"vanilla": "ppo_clip", "gspo": "gspo", "cispo": "cispo"}),
        ),
        # algorithm.rollout_correction: null means off
        "rollout_is": Option(
            "rollout_is", _one_of("rollout_is", {None: "none", "token": "token", "sequence": "sequence"})
        ),
        "rollout_is_threshold": Option("rollout_is_threshold", _verl_is_threshold),
        "rollout_rs": Option("rollout_rs", _verl_rollout_rs),
        "rollout_rs_threshold": Option("rollout_rs_bounds", jointly=_verl_rs_threshold),
        "rollout_is_batch_normalize": Option("rollout_is", _only(False)),
        "bypass_mode": Option("rollout_is", _only(False)),
    },
    package="verl",
)
"""verl 0.9.1 as released (core_algos, the engine workers' losses, rollout_corr_helper)."""

_TRL_1_10 = Profile(
    "trl-1.10",
    "TRL",
    "1.10.0.dev0 (f2cd5771)",
    {
        "grpo_std_normalization": True,
        "std_eps": 1e-4,
        "loss_agg_mode": "token_mean",
    },
    {
        "beta": Option("kl_loss_coef"),
        "epsilon": Option("eps_clip"),
        "epsilon_high": Option("eps_clip_high"),
        "num_generations": Option("n_samples_per_prompt"),
        "scale_rewards": Option(
            "grpo_std_normalization", lambda v: {"grpo_std_normalization": v not in (False, "none", "false")}
        ),
        "loss_type": Option(
            "loss_agg_mode",
            _choices(
                "loss_agg_mode",
                {
                    "dapo": {"loss_agg_mode": "token_mean"},
                    "bnpo": {"loss_agg_mode": "token_mean"},
                    "grpo": {"loss_agg_mode": "seq_mean_token_mean"},
                    "dr_grpo": {"loss_agg_mode": "seq_mean_token_sum_norm"},
                    "cispo": {"loss_agg_mode": "token_mean", "policy_loss": "cispo"},
                },
            ),
        ),
    },
)
"""TRL at the commit the first profile was read from, as it was modelled then (bundles that recorded it)."""


def _any(value: Any) -> Mapping[str, Any]:
    """An option that changes nothing replay recomputes (it acts upstream of the recorded values, or only together
    with an option that is refused otherwise): any value, which sets nothing."""
    return {}


def _bool(field_name: str) -> Callable[[Any], Mapping[str, Any]]:
    """A boolean option setting `field_name`; anything but a bool is refused."""

    def translate(value: Any) -> Mapping[str, Any]:
        if not isinstance(value, bool):
            raise ValueError("no recompute config field expresses this value (expected true or false)")
        return {field_name: value}

    return translate


def _trl_epsilon_high(value: Any, others: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's epsilon_high: None means epsilon's value (GRPOTrainer: `epsilon_high if not None else epsilon`)."""
    if value is None:
        return {}
    return _number("eps_clip_high")(value)


def _trl_delta(value: Any, others: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's delta (two-sided clipping): the unclipped ratio term capped at delta, min(min(ratio, delta) A, clip(ratio)
    A), which is the dual clip at delta where delta > 1 + epsilon_high (TRL's recommendation; below it the cap also
    acts on positive advantages, which no field expresses); None is off."""
    if value is None:
        return {"eps_clip_c": None}
    delta = _number("eps_clip_c")(value)["eps_clip_c"]
    high = next((others[k] for k in ("epsilon_high", "epsilon", "eps_clip_high") if others.get(k) is not None), 0.2)
    upper = 1.0 + _parse_number(high)
    if not delta > upper:
        raise ValueError(f"no recompute config field expresses a delta of at most 1 + epsilon_high ({upper})")
    return {"eps_clip_c": delta}


def _trl_importance_sampling_level(value: Any, others: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's importance_sampling_level: token (the loss type's own ratio) or sequence (GSPO: one ratio per sequence,
    clipped like PPO), which replay models for the clipped losses only; TRL then takes its clip ratios per sequence."""
    if value == "token":
        return {}
    if value != "sequence":
        raise ValueError("no recompute config field expresses this value (known values: token, sequence)")
    if others.get("policy_loss", "ppo_clip") != "ppo_clip":
        raise ValueError(f"no recompute config field expresses it with policy_loss {others['policy_loss']!r}")
    return {"policy_loss": "gspo", "clip_metric_agg": "micro_batch_seq_mean"}


def _trl_use_vllm(value: Any, others: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's use_vllm: generation by vLLM changes nothing replay recomputes, unless its importance sampling correction
    (vllm_importance_sampling_correction, on by default) scales the policy loss, which no field expresses."""
    if not isinstance(value, bool):
        raise ValueError("no recompute config field expresses this value (expected true or false)")
    if value and others.get("vllm_importance_sampling_correction", True):
        raise ValueError(
            "no recompute config field expresses vLLM's importance sampling correction "
            "(replayable with vllm_importance_sampling_correction=False)"
        )
    return {}


_TRL_1_16 = Profile(
    "trl-1.16",
    "TRL",
    "1.16.0",
    {
        "grpo_std_normalization": True,
        "std_eps": 1e-4,
        "nan_rewards": "exclude",
        "loss_agg_mode": "token_mean",
        "cispo_clip": "cap",
        "clip_metric_agg": "micro_batch_token_mean",
        "entropy_agg": "micro_batch_token_mean",
        "kl_loss_ratio_weighted": True,
        "loss_terms_reported": False,
    },
    {
        "loss_type": Option(
            "loss_agg_mode",
            _one_of_fields(
                {
                    "dapo": {"loss_agg_mode": "token_mean", "policy_loss": "ppo_clip"},
                    "bnpo": {"loss_agg_mode": "token_mean", "policy_loss": "ppo_clip"},
                    "grpo": {"loss_agg_mode": "seq_mean_token_mean", "policy_loss": "ppo_clip"},
                    "dr_grpo": {"loss_agg_mode": "seq_mean_token_sum_norm", "policy_loss": "ppo_clip"},
                    "cispo": {"loss_agg_mode": "token_mean", "policy_loss": "cispo"},
                }
            ),
            values=("dapo", "bnpo", "grpo", "dr_grpo", "cispo"),
        ),
        "beta": Option("kl_loss_coef", _number("kl_loss_coef")),
        "epsilon": Option("eps_clip", _number("eps_clip", "eps_clip_high")),
        "epsilon_high": Option("eps_clip_high", jointly=_trl_epsilon_high),
        "delta": Option("eps_clip_c", jointly=_trl_delta),
        "scale_rewards": Option(
            "grpo_std_normalization",
            _one_of_fields(
                {
                    "group": {"grpo_std_normalization": True, "std_scope": "group"},
                    "True": {"grpo_std_normalization": True, "std_scope": "group"},
                    "batch": {"grpo_std_normalization": True, "std_scope": "batch"},
                    "none": {"grpo_std_normalization": False, "std_scope": "group"},
                    "False": {"grpo_std_normalization": False, "std_scope": "group"},
                }
            ),
            values=("group", "batch", "none"),
        ),
        "use_bias_correction_kl": Option(
            "kl_loss_ratio_weighted", _bool("kl_loss_ratio_weighted"), values=(True, False)
        ),
        "importance_sampling_level": Option(
            "policy_loss", jointly=_trl_importance_sampling_level, values=("token", "sequence")
        ),
        "num_generations": Option("n_samples_per_prompt"),
        "entropy_coef": Option("entropy_coef", _number("entropy_coef")),
        "top_entropy_quantile": Option("loss_mask", _only(1.0, 1)),
        "use_adaptive_entropy": Option("entropy_coef", _only(False)),
        "multi_objective_aggregation": Option("grpo_std_normalization", _only("sum_then_normalize")),
        "off_policy_mask_threshold": Option("loss_mask", _only(None)),
        "router_aux_loss_coef": Option("loss", _only(None, 0.0, 0)),
        "use_vllm": Option("rollout_is", jointly=_trl_use_vllm),
        # recorded in the mask (mask_truncated_completions), the log-probs, the raw rewards or the old log-probs;
        # or acting only with a value another option refuses (vLLM's correction, sapo, vespo, adaptive entropy)
        **{
            name: Option(name, _any)
            for name in (
                "mask_truncated_completions",
                "num_iterations",
                "reward_weights",
                "sync_ref_model",
                "ref_model_mixup_alpha",
                "ref_model_sync_steps",
                "temperature",
                "vllm_importance_sampling_correction",
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
                "vllm_importance_sampling_cap",
                "sapo_temperature_neg",
                "sapo_temperature_pos",
                "vespo_k_pos",
                "vespo_lambda_pos",
                "vespo_k_neg",
                "vespo_lambda_neg",
                "entropy_coef_min",
                "entropy_coef_max",
                "entropy_coef_delta",
                "entropy_target",
            )
        },
    },
    package="trl",
)
"""TRL 1.16.0 as released (GRPOConfig's options and GRPOTrainer._compute_loss, _generate_and_score_completions)."""

NEWEST: dict[str, str] = {"verl": _VERL_0_9.name, "trl": _TRL_1_16.name}
"""A framework's bare profile name -> its newest modelled version, which the bare name is a copy of."""

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("relax", "relax", "1.0", {}),
        replace(_VERL_0_9, name="verl"),
        _VERL_0_9,
        _VERL_0_8,
        Profile(
            "slime",
            "slime",
            "0.3.1 (624b824a)",
            {"grpo_std_normalization": True, "kl_loss_estimator": "k1"},
            {
                "disable_grpo_std_normalization": Option(
                    "grpo_std_normalization", lambda v: {"grpo_std_normalization": not v}
                ),
                "kl_loss_type": Option("kl_loss_type", _both("kl_loss_type", "kl_loss_estimator")),
                "lambd": Option("lam"),
                "value_clip": Option("cliprange_value"),
                "advantage_estimator": Option(
                    "advantage_estimator",
                    _choices(
                        "advantage_estimator",
                        {
                            "ppo": {"advantage_estimator": "gae"},
                            "gspo": {"advantage_estimator": "grpo", "policy_loss": "gspo"},
                            "cispo": {"advantage_estimator": "grpo", "policy_loss": "cispo"},
                        },
                    ),
                ),
            },
        ),
        Profile(
            "openrlhf",
            "OpenRLHF",
            "0.11.0 (3c3be623)",
            {
                "grpo_std_normalization": True,
                "std_eps": 1e-9,
                "mask_advantages": True,
                "kl_output_clamp": 10.0,
                "ratio_log_clamp": 20.0,
                "loss_agg_mode": "token_mean",
                "kl_loss_estimator": "k1",
                "cliprange_value": 0.5,
            },
            {
                "estimator": Option(
                    "advantage_estimator",
                    _choices(
                        "advantage_estimator",
                        {
                            "group_norm": {"advantage_estimator": "grpo", "grpo_std_normalization": True},
                            "reinforce": {"advantage_estimator": "reinforce_plus_plus"},
                            "reinforce_baseline": {"advantage_estimator": "reinforce_plus_plus_baseline"},
                        },
                    ),
                ),
                "init_coef": Option("kl_coef"),
                "dual_clip": Option("eps_clip_c"),
                "value_clip": Option("cliprange_value"),
                "lambd": Option("lam"),
                "policy_loss_type": Option("policy_loss", _named("policy_loss", {"ppo": "ppo_clip"})),
            },
        ),
        replace(_TRL_1_16, name="trl"),
        _TRL_1_16,
        _TRL_1_10,
        Profile(
            "nemo_rl",
            "NeMo-RL",
            "0.6.0 (7ea279ab)",
            {
                "group_size_check": "any",
                "grpo_std_normalization": True,
                "kl_log_ratio_clamp": 20.0,
                "kl_output_clamp": 10.0,
                "loss_agg_mode": "token_mean",
                "kl_loss_coef": 0.01,
            },
            {
                "normalize_rewards": Option("grpo_std_normalization"),
                "reference_policy_kl_penalty": Option("kl_loss_coef"),
                "reference_policy_kl_type": Option("kl_loss_estimator"),
                "kl_input_clamp_value": Option("kl_log_ratio_clamp"),
                "kl_output_clamp_value": Option("kl_output_clamp"),
                "ratio_clip_min": Option("eps_clip"),
                "ratio_clip_max": Option("eps_clip_high"),
                "ratio_clip_c": Option("eps_clip_c"),
                "use_kl_in_reward": Option("kl_in_reward"),
                "token_level_loss": Option(
                    "loss_agg_mode", lambda v: {"loss_agg_mode": "token_mean" if v else "seq_mean_token_mean"}
                ),
                "gae_gamma": Option("gamma"),
                "gae_lambda": Option("lam"),
                "num_generations_per_prompt": Option("n_samples_per_prompt"),
            },
        ),
        Profile(
            "areal",
            "AReaL",
            "1.0.4 (4aef98d8)",
            {
                "grpo_std_normalization": True,
                "std_eps": 1e-5,
                "kl_output_clamp": 10.0,
                "loss_agg_mode": "token_mean",
                "cliprange_value": 0.5,
            },
            {
                "eps_clip_higher": Option("eps_clip_high"),
                "c_clip": Option("eps_clip_c"),
                "discount": Option("gamma"),
                "gae_lambda": Option("lam"),
                "kl_ctl": Option("kl_coef"),
                "kl_estimator": Option("kl_loss_type"),
                "group_size": Option("n_samples_per_prompt"),
            },
        ),
    )
}
"""Every profile, by name; `relax` (this tool's own conventions) is the default config."""


def profile(name: str) -> Profile:
    """The profile `name`; ValueError listing the profiles for an unknown one."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown convention profile {name!r}: profiles are {', '.join(PROFILES)}") from None


def recorded_profile(name: str, framework_version: str | None) -> str | None:
    """The profile a manifest's record means (`ConventionsRecord`: the profile's name and the framework version it
    modelled when the bundle was written): the named profile while it models that version, else the profile of the
    same framework pinned to it (a bundle that recorded `verl` when `verl` modelled 0.8 means `verl-0.8`), else the
    named profile; None for a name no profile has."""
    named = PROFILES.get(name)
    if named is None:
        return None
    if framework_version is None or named.framework_version == framework_version:
        return named.name
    pinned = (
        p.name
        for p in PROFILES.values()
        if p.framework == named.framework and p.framework_version == framework_version and p.name not in NEWEST
    )
    return next(pinned, named.name)


def installed_version(name: str) -> str | None:
    """The installed version of profile `name`'s framework (its `package`), for `RecomputeConfig.from_profile(...,
    framework_version=)`; None when it is not installed or the profile names no package."""
    from importlib.metadata import PackageNotFoundError, version

    package = profile(name).package
    if package is None:
        return None
    try:
        return version(package)
    except PackageNotFoundError:
        return None


__all__ = [
    "CONVENTION_FIELDS",
    "NEWEST",
    "Option",
    "PROFILES",
    "Profile",
    "installed_version",
    "profile",
    "recorded_profile",
]
