"""The judge's scoring (tools/train/judge.py) on what a phase shows, without streaming: a phase scores right only
for the typed colour on the typed background, the typed tone and, for a still shape, the typed outline; the first
phase's speed is the world's for a rendered motion."""
import dataclasses

import numpy as np
import pytest

from tools.train import judge, world
from tools.train.sample import Look, Span, Stream

pytestmark = pytest.mark.cpu

RED_CIRCLE = ("circle", "red", "black", "still")


def _look(colour=(220, 40, 40), background=(10, 10, 12), shape="circle", pitch=240.0) -> Look:
    return Look(request=0, phase=1, colour=colour, background=background, centroid=(160.0, 96.0), coverage=0.1,
                shape=shape, pitch_hz=pitch, balance_db=0.0)


def test_a_phase_that_shows_and_sounds_what_was_typed_scores_right_on_every_figure():
    assert judge.score(_look(), RED_CIRCLE) == judge.PhaseScore(0, 1, colour=True, tone=True, outline=True)


@pytest.mark.parametrize("look, wrong", [
    (_look(colour=(60, 110, 240)), "colour"),  # blue
    (_look(background=(105, 105, 110)), "colour"),  # on grey
    (_look(colour=(-1, -1, -1)), "colour"),  # no shape at all
    (_look(pitch=440.0), "tone"),
    (_look(shape="square"), "outline"),
])
def test_a_phase_scores_wrong_on_the_figure_it_misses_and_only_there(look, wrong):
    scored = judge.score(look, RED_CIRCLE)
    assert {f: getattr(scored, f) for f in ("colour", "tone", "outline")} == {
        f: f != wrong for f in ("colour", "tone", "outline")}


def test_a_moving_shapes_outline_is_not_scored():
    assert judge.score(_look(shape="unclear"), ("circle", "red", "black", "left")).outline is None


@pytest.mark.parametrize("motion", judge.MOTIONS)
def test_the_first_phases_speed_of_a_rendered_motion_is_the_worlds(motion):
    scene = world.Scene("circle", "red", "black", motion, 44.0, 160.0, 96.0)
    frames = world.render_video(scene, 0, 34)
    stream = Stream(frames, np.zeros((2, 1), np.float32), world.SAMPLE_RATE, [Span(0, 0, 0, 34)], None)
    assert judge.first_phase_speed(stream, motion) == pytest.approx(judge.world_speed(motion), abs=0.05)
    frames[10:] = frames[0, 0, 0]  # the shape gone after 10 of 34 frames: no speed
    assert np.isnan(judge.first_phase_speed(stream, motion))


@pytest.mark.parametrize("motion", judge.MOTIONS)
def test_a_shape_on_the_worlds_path_scores_one_and_a_shape_that_stopped_scores_near_nothing(motion):
    scene = world.opening_scene("circle", "red", "black", motion)
    frames = world.render_video(scene, 0, 240)  # 10 s: the world moves the shape 640 px (sideways) or 240 px
    stream = Stream(frames, np.zeros((2, 1), np.float32), world.SAMPLE_RATE, [Span(0, 0, 0, 240)], None)
    assert judge.path_iou(stream, scene) > 0.97  # the shape's anti-aliased rim is not its own colour
    frames[:] = frames[0]  # the shape stays where it opened: sideways 0.2, up or down (slower) 0.33
    assert judge.path_iou(stream, scene) < 0.35
    frames[:] = frames[0, 0, 0]  # no shape at all
    assert judge.path_iou(stream, scene) == 0.0


def test_totals_count_the_still_pairs_and_the_moving_ones_apart():
    right = dict(colour=True, tone=True, outline=True)
    pairs = [dict(still=True, phases=[right, dict(right, tone=False)]),
             dict(still=False, phases=[dict(right, outline=None), dict(right, colour=False, outline=None)])]
    assert judge.totals(pairs) == {"still": {"colour": [2, 2], "tone": [1, 2], "outline": [2, 2]},
                                   "moving": {"colour": [1, 2], "tone": [2, 2], "outline": [0, 0]}}


def _figures(outline=73, colour=84, up=0.77, bounce=0.35, place=2.2, square=10, held=5.0, update=7.0,
             white=11.2, walk=4.38) -> dict:
    """`judge`'s output as run D's model scored it (docs/training.md, "Run D's model", "Run F", "Run G" and "Run F
    at 3,214"), with figures to vary."""
    return {"totals": {"still": {"colour": [colour, 84], "tone": [84, 84], "outline": [outline, 84]},
                       "moving": {"colour": [27, 27], "tone": [27, 27], "outline": [0, 0]}},
            "speeds": {"left": {"path_iou": 0.65}, "right": {"path_iou": 0.59}, "up": {"path_iou": up},
                       "down": {"path_iou": 0.76}, "bounce": {"path_iou": bounce}},
            "balance": {c: {"worst_db": db, "seed": seed} for seed, (c, db) in
                        enumerate((("purple", 1.0), ("red", 4.4), ("green", 8.6), ("blue", 6.4), ("yellow", 9.9),
                                   ("white", white)))},
            "place": {"1": 1.6, "2": 1.5, "3": 1.0, "4": 1.2, "5": place},
            "meaning_seeds": {"0": {"square": [10, 10], "held_db": 1.7, "update_db": 1.0},
                              "1": {"square": [10, 10], "held_db": 1.3, "update_db": 1.3},
                              "2": {"square": [10, 10], "held_db": 5.7, "update_db": 7.2},
                              "3": {"square": [square, 10], "held_db": held, "update_db": update}},
            "teacher": {"worst_mean": walk, "over": 5, "seeds": 24}}


def test_run_ds_figures_reach_the_floor_of_a_reproduction_and_the_bounce_is_not_held_to_it():
    assert judge.shortfalls(_figures()) == []
    assert judge.shortfalls(_figures(bounce=0.0)) == []


@pytest.mark.parametrize("figures, named", [
    (_figures(outline=59), "still outline 59/84 (floor 60)"),
    (_figures(colour=83), "still colour 83/84 (floor 84)"),
    (_figures(up=0.45), "path IoU moving up 0.45 (floor 0.45)"),
    (_figures(place=14.8), "still opening at seed 5 14.8 px from the centre (at most 8)"),
    (_figures(square=5), "the square after the update 35/40 (floor 90%)"),
    (_figures(walk=6.0), "the sound's walk 6.00 dB, the worst second's mean over 24 independent seeds (at most "
                         "5.0)"),
])
def test_each_figure_below_the_floor_is_named_with_its_value_and_only_it(figures, named):
    assert judge.shortfalls(figures) == [named]


def test_a_streamed_sessions_balance_alone_is_one_draw_and_not_held_to_the_floor():
    assert judge.shortfalls(_figures(held=8.3, update=17.0, white=30.0)) == []


def test_the_sounds_walk_is_the_mean_of_each_seeds_worst_second_and_counts_those_past_the_held_limit():
    walk = judge.teacher_walk([1.0, 7.0, 4.0, 6.0])
    assert walk == {"worst_mean": pytest.approx(4.5), "over": 1, "seeds": 4}  # 6.0 is within the limit


def test_the_walks_seeds_share_no_audio_noise():
    # request k of a session at seed s draws its audio noise from generator s + k (`runtime.request_noise`)
    draws = [{s + k for k in range(judge.HELD_REQUESTS + 1)} for s in judge.TEACHER_SEEDS]
    assert sum(map(len, draws)) == len(set().union(*draws))
    assert len(judge.TEACHER_SEEDS) >= 24


def test_the_worst_balance_is_the_largest_stray_either_way_and_names_its_request():
    lks = [Look(request=r, phase=0, colour=(240, 210, 50), background=(10, 10, 12), centroid=(160.0, 96.0),
                coverage=0.1, shape="circle", pitch_hz=640.0, balance_db=db)
           for r, db in enumerate((0.8, -2.5, 1.9, -6.3, 4.0))]
    assert judge.worst_balance(lks) == (6.3, 3)


def test_the_worst_place_is_request_0s_farthest_phase_from_the_worlds_centre_and_no_shape_is_far():
    scene = world.opening_scene(*judge.PLACED)
    lks = [Look(request=r, phase=p, colour=(60, 106, 239), background=(10, 10, 12), centroid=(x, 94.0),
                coverage=0.1, shape="square", pitch_hz=440.0, balance_db=0.0)
           for r, p, x in ((0, 0, 165.2), (0, 1, 151.1), (0, 2, 158.0), (1, 0, 190.0))]
    assert judge.worst_place(lks, scene) == pytest.approx(8.9)  # request 1 is not the opening's
    lks[2] = dataclasses.replace(lks[2], centroid=(-1.0, -1.0))  # a phase with no shape
    assert judge.worst_place(lks, scene) > judge.PLACE_LIMIT


def test_the_square_after_an_update_counts_the_later_requests_phases_that_read_as_it():
    lks = [Look(request=r, phase=p, colour=(60, 106, 239), background=(18, 29, 89), centroid=(160.0, 96.0),
                coverage=0.1, shape=shape, pitch_hz=440.0, balance_db=0.0)
           for r, p, shape in ((0, 0, "circle"), (0, 1, "circle"), (1, 0, "unclear"), (1, 1, "square"),
                               (2, 0, "triangle"), (2, 1, "square"))]
    assert judge.square_after_update(lks, "square") == (2, 4)  # request 0's circles are not counted
